"""Tracing without a model: the per-request ``Trace`` (hotlora.tracing), the server's root span and
its W3C traceparent, trace ids in log lines, the ``otlp_endpoint`` setting, and an engine that
never needs OpenTelemetry. The spans of a real generation: tests/e2e/test_observability.py."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hotlora.server.tracing import Tracing, traces_url
from hotlora.tracing import NO_TRACE, together

SRC = Path(__file__).resolve().parents[2] / "src"
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture
def traced():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing = Tracing(provider)
    yield tracing, memory
    tracing.shutdown()


def by_name(memory):
    return {span.name: span for span in memory.get_finished_spans()}


def test_spans_nest_under_the_request_span_which_continues_the_clients_trace(traced):
    tracing, memory = traced
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    with tracing.request(headers, "POST", "/v1/generate") as trace:
        with trace.span("swap", images=3):
            with trace.span("inner"):
                pass
        trace.record("queue_wait", 1_000, 2_000)
    spans = by_name(memory)
    root = spans["POST /v1/generate"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID and f"{root.parent.span_id:016x}" == PARENT_ID
    assert spans["swap"].parent.span_id == root.context.span_id and spans["swap"].attributes["images"] == 3
    assert spans["inner"].parent.span_id == spans["swap"].context.span_id  # nested, not a sibling
    assert spans["queue_wait"].parent.span_id == root.context.span_id
    assert (spans["queue_wait"].start_time, spans["queue_wait"].end_time) == (1_000, 2_000)
    assert {s.context.trace_id for s in spans.values()} == {int(TRACE_ID, 16)}


def test_without_a_traceparent_each_request_starts_its_own_trace(traced):
    tracing, memory = traced
    for _ in range(2):
        with tracing.request({}, "POST", "/v1/generate"):
            pass
    first, second = memory.get_finished_spans()
    assert first.parent is None and second.parent is None
    assert first.context.trace_id != second.context.trace_id


def test_a_failed_request_is_recorded_on_its_span(traced):
    tracing, memory = traced
    with pytest.raises(ValueError):
        with tracing.request({}, "POST", "/v1/generate"):
            raise ValueError("no")
    (span,) = memory.get_finished_spans()
    assert span.status.status_code.name == "ERROR" and span.events[0].name == "exception"


def test_a_shared_batch_opens_its_spans_in_every_requests_trace(traced):
    tracing, memory = traced
    with tracing.request({}, "POST", "/a") as first, tracing.request({}, "POST", "/b") as second:
        with together([first, NO_TRACE, second]).span("denoise", images=6):
            pass
    spans = memory.get_finished_spans()
    roots = {s.name: s for s in spans if s.name.startswith("POST")}
    denoise = [s for s in spans if s.name == "denoise"]
    assert sorted(s.parent.span_id for s in denoise) == sorted(r.context.span_id for r in roots.values())
    assert together([NO_TRACE]) is NO_TRACE


def test_log_lines_carry_the_trace_id_while_a_span_is_current(traced, caplog):
    tracing, _ = traced
    caplog.set_level(logging.INFO, logger="hotlora.test")
    log = logging.getLogger("hotlora.test")
    with tracing.request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, "POST", "/v1/generate") as trace:
        with trace.span("swap"):
            log.info("inside %s", "the request")
    log.info("outside")
    inside, outside = [r.getMessage() for r in caplog.records]
    assert inside.startswith("inside the request trace_id=" + TRACE_ID + " span_id=")
    assert outside == "outside"
    installed = logging.getLogRecordFactory()
    tracing.shutdown()
    assert logging.getLogRecordFactory() is installed.previous  # taken away with the tracer


def test_no_endpoint_no_tracing():
    tracing = Tracing.from_endpoint(None)
    assert not tracing.enabled
    with tracing.request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, "POST", "/v1/generate") as trace:
        assert trace is NO_TRACE
        with trace.span("swap"):
            pass


def test_the_endpoint_is_the_collectors_base_address():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"


def test_otlp_endpoint_is_a_flag_a_variable_and_a_config_key(tmp_path, monkeypatch):
    from hotlora.cli import build_parser, serve_settings
    from hotlora.settings import ServerConfig

    assert ServerConfig().otlp_endpoint is None
    args = build_parser().parse_args(["serve", "--otlp-endpoint", "http://127.0.0.1:4318"])
    assert serve_settings(args)[0].otlp_endpoint == "http://127.0.0.1:4318"
    monkeypatch.setenv("HOTLORA_OTLP_ENDPOINT", "http://collector:4318")
    assert serve_settings(build_parser().parse_args(["serve"]))[0].otlp_endpoint == "http://collector:4318"
    config = tmp_path / "hotlora.toml"
    config.write_text('[server]\notlp_endpoint = "http://file:4318"\n')
    monkeypatch.delenv("HOTLORA_OTLP_ENDPOINT")
    assert serve_settings(build_parser().parse_args(["serve", "--config", str(config)]))[0].otlp_endpoint == \
        "http://file:4318"


def test_the_engine_and_a_server_without_an_endpoint_run_without_opentelemetry():
    """OpenTelemetry made unimportable: the engine's modules import, a server's tracing is off, and
    asking for an endpoint says which extra to install."""
    script = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None\n"  # any import of it now raises ImportError
        "import hotlora.engine.core, hotlora.engine.worker, hotlora.engine.runner\n"
        "from hotlora.server.tracing import Tracing\n"
        "from hotlora.settings.fields import SettingsError\n"
        "assert not Tracing.from_endpoint(None).enabled\n"
        "try:\n"
        "    Tracing.from_endpoint('http://127.0.0.1:4318')\n"
        "except SettingsError as exc:\n"
        "    assert \"hotlora[otel]\" in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
