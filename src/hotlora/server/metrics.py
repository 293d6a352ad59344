"""Prometheus metrics, named by convention: counters and histograms updated per request, live values
read at scrape.

Conventions (Prometheus' naming guide): every name starts ``hotlora_``; durations are histograms
in seconds (``_seconds``); counters end ``_total``; the unit ends the name (``_bytes``,
``_images``, ``_fraction``). Labels are few and bounded: ``api`` (the matched route's template,
or ``unmatched``), ``outcome``, ``stage``, ``tier``. Nothing a caller chooses becomes a label (no
request id, prompt, adapter reference or hash), so the series stay the same however many adapters
are served (tests/e2e/test_observability.py checks it). docs/observability.md lists them all;
deploy/observability/ has the dashboard and alert rules built on them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# A generation's stages, in order (the queue wait has its own histogram).
STAGES = ("fetch", "validate", "swap", "text_encoders", "denoise", "decode", "encode")
OUTCOMES = ("ok", "rejected", "client_error", "server_error")
TIERS = ("ram", "disk")
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Fused mode's kept fraction: fine near 1, where fused_min_kept (0.98 by default) draws its line.
KEPT_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)


class Metrics:
    def __init__(self, worker, service=None):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("hotlora_requests", "HTTP POST requests by route template and outcome",
                                ["api", "outcome"], registry=registry)  # exposed as hotlora_requests_total
        self.latency = Histogram("hotlora_request_duration_seconds", "HTTP POST requests: time from arrival to "
                                 "the last byte of the answer, by route template and outcome", ["api", "outcome"],
                                 buckets=BUCKETS, registry=registry)
        self.queue_wait = Histogram("hotlora_queue_wait_seconds", "Generations: time from queued to started on "
                                    "the engine", buckets=BUCKETS, registry=registry)
        self.stage = Histogram("hotlora_stage_seconds", "Generations: time per stage (fetch, validate, swap, "
                               "text_encoders, denoise, decode, encode)", ["stage"], buckets=BUCKETS,
                               registry=registry)
        self.cold_fetch = Histogram("hotlora_adapter_fetch_seconds", "Adapters fetched from their source (not "
                                    "cached): download and conversion", buckets=BUCKETS, registry=registry)
        self.batch = Histogram("hotlora_batch_images", "Images per forward batch (a chunk of a pack, or a "
                               "mixed batch)", buckets=BATCH_BUCKETS, registry=registry)
        self.fused_kept = Histogram("hotlora_fused_kept_fraction", "Fused mode: the fraction of each request's "
                                    "weight delta the merged weights carry", buckets=KEPT_BUCKETS,
                                    registry=registry)
        # Bounded label: "fused" (merged into the weights) or "slots" (unfused branches, slots or banks).
        self.adapter_mode = Counter("hotlora_adapter_mode", "Requests with adapters, by the path that served "
                                    "them (auto mode chooses per request)", ["mode"], registry=registry)
        self.dropped = Counter("hotlora_requests_dropped", "Requests dropped before they started: client gone",
                               registry=registry)
        for stage in STAGES:  # every series exists from the first scrape (rate() needs a start)
            self.stage.labels(stage)
        registry.register(_Live(worker, service))

    def on_event(self, name: str, data: dict) -> None:
        """The worker's and the store's events (``Worker.on_event``)."""
        if name == "dropped":
            self.dropped.inc()
        elif name == "forward_batch":
            self.batch.observe(data["images"])
        elif name == "adapter_fetched":
            self.cold_fetch.observe(data["seconds"])

    def observe_request(self, api: str, outcome: str, seconds: float) -> None:
        self.requests.labels(api, outcome).inc()
        self.latency.labels(api, outcome).observe(seconds)

    def observe(self, timings: dict, adapters: dict | None = None) -> None:
        """One generation's timings (the response's ``*_ms``, plus ``decode_ms`` when measured)."""
        entries = [entry for entry in (adapters or {}).values() if entry]
        kept = [e["fused_kept"] for e in entries if "fused_kept" in e and e.get("mode") == "fused"]
        if kept:  # one value per request: its slots are merged together
            self.fused_kept.observe(min(kept))
        for mode in {e["mode"] for e in entries if e.get("mode") in ("fused", "slots")}:  # one per request
            self.adapter_mode.labels(mode).inc()
        if timings.get("queue_ms") is not None:
            self.queue_wait.observe(timings["queue_ms"] / 1000)
        stages = {"fetch": "fetch_ms", "validate": "prepare_ms", "swap": "swap_ms", "text_encoders": "text_encoders_ms",
                  "encode": "encode_ms"}
        for stage, key in stages.items():
            if timings.get(key) is not None:
                self.stage.labels(stage).observe(timings[key] / 1000)
        if timings.get("generate_ms") is not None:  # denoise + decode, split where the decode was measured
            decode = timings.get("decode_ms")
            self.stage.labels("denoise").observe((timings["generate_ms"] - (decode or 0)) / 1000)
            if decode is not None:
                self.stage.labels("decode").observe(decode / 1000)


class _Live:
    """Values that belong to the worker, the service and the store, read when Prometheus scrapes."""

    def __init__(self, worker, service=None):
        self.worker = worker
        self.service = service

    def collect(self):
        worker, engine = self.worker, self.worker.engine
        yield GaugeMetricFamily("hotlora_ready", "1 when warm, compiled and accepting", value=int(worker.ready))
        yield GaugeMetricFamily("hotlora_queue_depth", "Generations queued for the engine", value=worker.depth)
        yield GaugeMetricFamily("hotlora_queue_capacity", "Generations the queue holds (429 beyond: max_queue)",
                                value=worker.max_queue)
        if self.service is not None:
            yield GaugeMetricFamily("hotlora_requests_in_flight", "Generations admitted: validating, queued or "
                                    "running", value=self.service.pending)
            yield GaugeMetricFamily("hotlora_requests_in_flight_limit", "Generations admitted at most (429 beyond)",
                                    value=self.service.max_pending)
        yield CounterMetricFamily("hotlora_engine_rebuilds", "Engine rebuilds after engine faults",
                                  value=worker.rebuilds)
        restarts = CounterMetricFamily("hotlora_engine_restarts", "Engine processes replaced after they died "
                                       "(signal: killed or crashed; exit: exited; stall: silent past the deadline)",
                                       labels=["cause"])
        for cause in ("signal", "exit", "stall"):
            restarts.add_metric([cause], worker.restarts.get(cause, 0))
        yield restarts
        yield CounterMetricFamily("hotlora_mixed_batches", "Forward batches that carried several requests",
                                  value=worker.batches)
        yield CounterMetricFamily("hotlora_recompiles", "Dynamo graphs compiled by requests after warm-up, every "
                                  "engine of this process (must stay 0)",
                                  value=worker.retired_recompiles + (engine.recompiles if engine else 0))
        yield GaugeMetricFamily("hotlora_adapters_active", "Distinct adapters bound by the last forward batch",
                                value=engine.active_adapters if engine else 0)
        store = self.service.store if self.service is not None else None
        if store is None:
            return
        stats = store.stats()
        yield from _per_tier(stats, CounterMetricFamily, "hotlora_cache_hits", "Adapter cache hits", "hits")
        yield from _per_tier(stats, CounterMetricFamily, "hotlora_cache_misses", "Adapter cache misses", "misses")
        yield from _per_tier(stats, CounterMetricFamily, "hotlora_cache_evictions", "Adapters evicted", "evictions")
        yield from _per_tier(stats, GaugeMetricFamily, "hotlora_cache_bytes", "Bytes held per cache tier", "bytes")
        yield from _per_tier(stats, GaugeMetricFamily, "hotlora_adapters_cached", "Adapters held per cache tier "
                             "(ram: loaded, ready to swap in)", "entries")
        remote = stats["remote"]
        yield CounterMetricFamily("hotlora_adapter_fetches", "Adapters fetched from their source",
                                  value=remote["fetches"])
        yield CounterMetricFamily("hotlora_adapter_fetched_bytes", "Bytes fetched from adapter sources",
                                  value=remote["bytes"])
        yield GaugeMetricFamily("hotlora_adapter_fetches_in_flight", "Adapter fetches queued or running",
                                value=remote["in_flight"])


def _per_tier(stats: dict, kind, name: str, doc: str, key: str):
    family = kind(name, doc, labels=["tier"])
    for tier in TIERS:
        family.add_metric([tier], stats[tier][key])
    yield family
