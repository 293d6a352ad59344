"""Prometheus metrics: counters and histograms updated per request, live values read at scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STAGES = ("queue", "fetch", "prepare", "swap", "generate", "encode", "total")
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Fused mode's kept fraction: fine near 1, where fused_min_kept (0.98 by default) draws its line.
KEPT_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)


class Metrics:
    def __init__(self, worker):
        self.registry = CollectorRegistry()
        self.requests = Counter("hotlora_requests", "Requests by API and outcome", ["api", "outcome"],
                                registry=self.registry)
        self.stage = Histogram("hotlora_stage_seconds", "Time per request stage", ["stage"], buckets=BUCKETS,
                               registry=self.registry)
        self.swap = Histogram("hotlora_swap_seconds", "Time to swap the slots", buckets=BUCKETS, registry=self.registry)
        self.fused_kept = Histogram("hotlora_fused_kept_fraction", "Fused mode: the fraction of each request's "
                                    "weight delta the merged weights carry", buckets=KEPT_BUCKETS,
                                    registry=self.registry)
        # Bounded label: "fused" (merged into the weights) or "slots" (unfused branches, slots or banks).
        self.adapter_mode = Counter("hotlora_adapter_mode", "Requests with adapters, by the path that served "
                                    "them (auto mode chooses per request)", ["mode"], registry=self.registry)
        self.dropped = Counter("hotlora_dropped", "Requests dropped before they started: client gone",
                               registry=self.registry)
        self.registry.register(_Live(worker))

    def on_event(self, name: str, data: dict) -> None:
        if name == "dropped":
            self.dropped.inc()

    def observe(self, timings: dict, adapters: dict | None = None) -> None:
        entries = [entry for entry in (adapters or {}).values() if entry]
        kept = [e["fused_kept"] for e in entries if "fused_kept" in e and e.get("mode") == "fused"]
        if kept:  # one value per request: its slots are merged together
            self.fused_kept.observe(min(kept))
        for mode in {e["mode"] for e in entries if e.get("mode") in ("fused", "slots")}:  # one per request
            self.adapter_mode.labels(mode).inc()
        for stage in STAGES:
            value = timings.get(f"{stage}_ms")
            if value is not None:
                self.stage.labels(stage).observe(value / 1000)
        if timings.get("swap_ms") is not None:
            self.swap.observe(timings["swap_ms"] / 1000)


class _Live:
    """Values that belong to the worker and the store, read when Prometheus scrapes."""

    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        engine = self.worker.engine
        yield GaugeMetricFamily("hotlora_ready", "1 when warm, compiled and accepting", value=int(self.worker.ready))
        yield GaugeMetricFamily("hotlora_queue_depth", "Jobs waiting for the engine", value=self.worker.depth)
        yield CounterMetricFamily("hotlora_engine_rebuilds", "Engine rebuilds after engine faults",
                                  value=self.worker.rebuilds)
        yield CounterMetricFamily("hotlora_mixed_batches", "Forward batches that carried several requests",
                                  value=self.worker.batches)
        yield GaugeMetricFamily("hotlora_recompiles", "Dynamo graphs compiled by requests since warm-up (current engine)",
                                value=engine.recompiles if engine else 0)
        store = self.worker.store
        if store is None:
            return
        stats = store.stats()
        for name, doc in (("hits", "Cache hits"), ("misses", "Cache misses")):
            family = CounterMetricFamily(f"hotlora_cache_{name}", doc, labels=["tier"])
            for tier in ("ram", "disk"):
                family.add_metric([tier], stats[tier][name])
            yield family
        bytes_held = GaugeMetricFamily("hotlora_cache_bytes", "Bytes held per cache tier", labels=["tier"])
        for tier in ("ram", "disk"):
            bytes_held.add_metric([tier], stats[tier]["bytes"])
        yield bytes_held
        yield CounterMetricFamily("hotlora_adapter_fetches", "Adapters fetched from their source",
                                  value=stats["remote"]["fetches"])
