"""Metrics and traces of a real server (uvicorn on 127.0.0.1, the tiny Flux model, eager: these
tests are about what the server reports, and an eager engine starts in seconds).

The server exports its spans over OTLP/HTTP to a receiver in this module (a small HTTP server that
decodes the protobuf ``ExportTraceServiceRequest`` with opentelemetry-proto), and, through a second
span processor, to the SDK's ``InMemorySpanExporter``. /metrics is scraped after requests with many
distinct adapters: names follow Prometheus' conventions (and its own linter, ``promtool check
metrics``) and the series do not grow with the adapters.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hotlora.testing import random_lora, save_diffusers_lora

from ..helpers import generate, pixels

REPO = Path(__file__).resolve().parents[2]
OBSERVABILITY = REPO / "deploy" / "observability"
STAGE_SPANS = {"admission", "fetch", "validate", "queue_wait", "swap", "denoise", "decode", "encode"}
ADAPTERS = 16  # distinct adapters, served in two rounds of 8
# every label /metrics may carry: all bounded (mode: fused | slots; cause: signal | exit | stall)
LABELS = {"api", "outcome", "stage", "tier", "mode", "cause", "le"}
PROMTOOL = shutil.which("promtool") or "promtool"  # Debian's prometheus package; `make test` installs it


class OtlpReceiver(http.server.BaseHTTPRequestHandler):
    """OTLP/HTTP's traces endpoint: decodes each export, keeps (resource attributes, span) pairs."""

    def do_POST(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest, ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["content-length"]))
        ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
        if ok:
            export = ExportTraceServiceRequest.FromString(body)
            for resource_spans in export.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    with self.server.lock:
                        self.server.spans.extend((resource, span) for span in scope_spans.spans)
        answer = ExportTraceServiceResponse().SerializeToString() if ok else b""
        self.send_response(200 if ok else 400)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def observed(tiny_models, tmp_path_factory, start_server):
    """The server, its adapters' folder, the OTLP receiver and the in-memory exporter."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tmp = tmp_path_factory.mktemp("observability")
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(tiny_models["flux"] / "transformer")
    linears = {n: (m.in_features, m.out_features) for n, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear)}
    for i in range(ADAPTERS):
        save_diffusers_lora(tmp / "loras" / f"user-{i}", "flux", random_lora(linears, 2, seed=500 + i), rank=2, alpha=2)

    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OtlpReceiver)
    receiver.spans, receiver.lock, receiver.daemon_threads = [], threading.Lock(), True
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    previous = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the batch processor exports every 100 ms, not 5 s
    try:
        server = start_server(tiny_models["flux"], tmp, roots=(tmp / "loras",), compile=False,
                              otlp_endpoint=f"http://127.0.0.1:{receiver.server_address[1]}")
    finally:
        if previous is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = previous
    tracing = server.server.config.app.state.service.tracing
    memory = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(memory))
    yield server, tmp / "loras", receiver, memory
    tracing.shutdown()  # flushed to the receiver while it still listens; the server traces no more
    receiver.shutdown()
    receiver.server_close()


def traced_request(server, root, *, trace_id: str, parent_id: str, n: int = 4):
    """A generation whose client sent a W3C traceparent; 4 images in chunks of 3 + 1."""
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    with httpx.Client(headers=headers) as client:
        response = generate(server.url, identity=(str(root / "user-0"), 0.8), style=(str(root / "user-1"), 0.5),
                            n=n, client=client)
    assert pixels(response).shape[0] == n
    return response


def test_one_generation_is_one_trace_under_the_clients_traceparent(observed, caplog):
    server, root, _, memory = observed
    caplog.set_level(logging.INFO, logger="hotlora.server.service")
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traced_request(server, root, trace_id=trace_id, parent_id=parent_id)

    spans = [s for s in memory.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
    roots = [s for s in spans if s.name == "POST /v1/generate"]
    assert len(roots) == 1, [s.name for s in spans]
    request_span = roots[0]
    assert f"{request_span.parent.span_id:016x}" == parent_id and request_span.parent.is_remote  # the client's
    assert request_span.attributes["http.route"] == "/v1/generate"
    children = [s for s in spans if s is not request_span]
    assert {s.name for s in children} == STAGE_SPANS
    assert all(s.parent.span_id == request_span.context.span_id for s in children)  # one level, one trace
    names = [s.name for s in children]
    assert names.count("denoise") == 2 and names.count("decode") == 2  # per chunk: 3 images, then 1
    assert sorted(s.attributes["images"] for s in children if s.name == "denoise") == [1, 3]
    assert names.count("swap") == 3  # the text encoders once, the denoiser's slots per chunk
    for denoise, decode in zip(*(sorted((s for s in children if s.name == n), key=lambda s: s.start_time)
                                 for n in ("denoise", "decode"))):
        assert denoise.start_time < denoise.end_time <= decode.start_time < decode.end_time
    assert all(request_span.start_time <= s.start_time and s.end_time <= request_span.end_time for s in children)

    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generated 4 images")]
    assert logged and all(f"trace_id={trace_id}" in line for line in logged), logged


def test_a_real_otlp_http_receiver_gets_the_requests_spans(observed):
    server, root, receiver, _ = observed
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    traced_request(server, root, trace_id=trace_id, parent_id=parent_id)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the batch processor sends every 100 ms here
        with receiver.lock:
            received = [(resource, span) for resource, span in receiver.spans if span.trace_id.hex() == trace_id]
        if {span.name for _, span in received} >= STAGE_SPANS | {"POST /v1/generate"}:
            break
        time.sleep(0.1)
    names = {span.name for _, span in received}
    assert names == STAGE_SPANS | {"POST /v1/generate"}
    request_span = next(span for _, span in received if span.name == "POST /v1/generate")
    assert request_span.parent_span_id.hex() == parent_id
    assert all(span.parent_span_id == request_span.span_id for _, span in received if span is not request_span)
    assert {resource["service.name"] for resource, _ in received} == {"hotlora"}


def scrape(url) -> dict[str, set]:
    """Family name -> its samples as (sample name, sorted labels); also checks the text parses."""
    families = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        families[family.name] = (family.type, {(s.name, tuple(sorted(s.labels.items()))) for s in family.samples})
    return families


def test_metrics_follow_the_conventions_and_do_not_grow_with_adapters(observed):
    server, root, _, _ = observed
    rounds = []
    for first in (0, ADAPTERS // 2):
        for i in range(first, first + ADAPTERS // 2):
            response = generate(server.url, identity=(str(root / f"user-{i}"), 0.5 + i / 100), n=1,
                                num_inference_steps=1, prompt=f"prompt number {i}")
            assert response.status_code == 200, response.text
        assert generate(server.url, identity=(str(root / "absent"), 1.0), n=1).status_code == 404
        rounds.append(scrape(server.url))
    first, second = rounds
    series = {name: {labels for _, labels in samples} for name, (_, samples) in second.items()}
    assert {n: {l for _, l in s} for n, (_, s) in first.items()} == series  # 8 more adapters, no new series

    for name, (kind, samples) in second.items():
        assert name.startswith("hotlora_") and not name.endswith("_ms"), name
        sample_names = {sample for sample, _ in samples}
        if kind == "counter":
            assert sample_names <= {f"{name}_total", f"{name}_created"}, (name, sample_names)
        elif kind == "histogram":
            assert name.endswith(("_seconds", "_images", "_fraction")), name
            assert sample_names <= {f"{name}_{s}" for s in ("bucket", "sum", "count", "created")}, name
        else:
            assert kind == "gauge" and not name.endswith("_total"), (name, kind)
        for _, labels in samples:
            assert {key for key, _ in labels} <= LABELS, (name, labels)
            values = " ".join(value for _, value in labels)
            assert "user-" not in values and "prompt" not in values and not re.search(r"[0-9a-f]{16}", values)
    label_values = {(key, value) for _, samples in second.values() for _, labels in samples
                    for key, value in labels if key != "le"}
    assert len(label_values) < 40, sorted(label_values)  # route templates, outcomes, stages, tiers

    text = httpx.get(f"{server.url}/metrics").text
    linted = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert linted.returncode == 0, linted.stdout + linted.stderr  # Prometheus' own naming linter: no problem
    assert 'hotlora_requests_total{api="/v1/generate",outcome="ok"}' in text
    assert 'hotlora_requests_total{api="/v1/generate",outcome="client_error"}' in text  # the absent adapter
    values = {s.name + json.dumps(s.labels, sort_keys=True): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert values['hotlora_adapter_fetch_seconds_count{}'] >= ADAPTERS  # each adapter fetched cold once
    assert values['hotlora_queue_wait_seconds_count{}'] >= ADAPTERS
    for stage in ("fetch", "validate", "swap", "denoise", "decode", "encode"):
        assert values['hotlora_stage_seconds_count{"stage": "%s"}' % stage] >= ADAPTERS, stage
    assert values['hotlora_batch_images_count{}'] >= ADAPTERS
    assert values['hotlora_adapters_cached{"tier": "ram"}'] >= ADAPTERS
    assert values['hotlora_adapters_active{}'] == 1  # the last request named one adapter
    assert values['hotlora_recompiles_total{}'] == 0 and values['hotlora_engine_rebuilds_total{}'] == 0


def promql_metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bhotlora_[a-z0-9_]+\b", expr))


def test_the_dashboard_and_the_alerts_read_only_metrics_the_server_exports(observed):
    import yaml

    server, root, _, _ = observed
    assert generate(server.url, identity=(str(root / "user-2"), 1.0), n=1).status_code == 200
    exported = {sample for _, samples in scrape(server.url).values() for sample, _ in samples}
    rules = yaml.safe_load((OBSERVABILITY / "alerts.yml").read_text())
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    expressions = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    expressions += [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(expressions) > 10
    for expr in expressions:
        names = promql_metric_names(expr)
        assert names, expr
        assert names <= exported, (expr, names - exported)
