"""OpenTelemetry traces of generation requests: opt-in (``otlp_endpoint``), one trace per request.

The server opens each generation's root span (a SERVER span named after its route), under the
caller's W3C ``traceparent`` when it sent one (OpenTelemetry's own propagator reads it), and hands
the engine a ``hotlora.tracing.SpanTrace`` for the spans below it: admission, fetch, validate,
queue_wait, swap, denoise and decode (one each per chunk), encode. Spans leave through the
SDK's ``BatchSpanProcessor`` and OTLP/HTTP exporter (``pip install 'hotlora[otel]'``).

Why not ``opentelemetry-instrumentation-fastapi``: it traces every route and every ASGI message
(health probes, metrics scrapes, one span per body chunk), while what an operator needs is one
trace per generation with its stages; the few lines here do only that, with the SDK's parts.

Log lines written while a span is current carry its ids (``trace_id=... span_id=...``, and the
``otelTraceID`` / ``otelSpanID`` record attributes OpenTelemetry's logging instrumentation uses),
so a slow request's log lines and its trace find each other.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Iterator, Mapping

from hotlora.settings.fields import SettingsError
from hotlora.tracing import NO_TRACE, SpanTrace, Trace

log = logging.getLogger(__name__)
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans, appended to the collector's base address


def traces_url(endpoint: str) -> str:
    """The collector's base address (``http://collector:4318``, as ``OTEL_EXPORTER_OTLP_ENDPOINT``
    takes it) -> its traces URL; a URL that already ends in ``/v1/traces`` is kept."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


class Tracing:
    """The server's tracer. ``provider``: an SDK ``TracerProvider`` (None: tracing off)."""

    def __init__(self, provider=None):
        self.provider = provider
        self.tracer = provider.get_tracer("hotlora") if provider is not None else None
        self._factory = None
        if provider is not None:
            self._install_log_ids()

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @classmethod
    def from_endpoint(cls, endpoint: str | None) -> "Tracing":
        """Spans exported over OTLP/HTTP to ``endpoint``; None: no tracing, nothing imported."""
        if not endpoint:
            return cls()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise SettingsError(f"otlp_endpoint is set but OpenTelemetry is not installed ({exc}); "
                                "pip install 'hotlora[otel]'") from None
        from hotlora import __version__

        attributes = {"service.version": __version__}
        if not os.environ.get("OTEL_SERVICE_NAME"):  # the standard variable wins when set
            attributes["service.name"] = "hotlora"
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        log.info("tracing: spans go to %s", traces_url(endpoint))
        return cls(provider)

    @contextmanager
    def request(self, headers: Mapping[str, str], method: str, route: str) -> Iterator[Trace]:
        """The root span of one generation (current on this task while it runs), as the engine's
        ``Trace``. An exception is recorded on the span and raised on."""
        if not self.enabled:
            yield NO_TRACE
            return
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier=headers)  # W3C traceparent, if any
        attributes = {"http.request.method": method, "http.route": route}
        with self.tracer.start_as_current_span(f"{method} {route}", context=parent, kind=trace.SpanKind.SERVER,
                                               attributes=attributes) as span:
            yield SpanTrace(self.tracer, trace.set_span_in_context(span, parent))

    def shutdown(self) -> None:
        """Export what is buffered, stop the exporter, and take the log ids away."""
        if self._factory is not None and logging.getLogRecordFactory() is self._factory:
            logging.setLogRecordFactory(self._factory.previous)
        self._factory = None
        provider, self.provider, self.tracer = self.provider, None, None  # once; later requests: untraced
        if provider is not None:
            provider.shutdown()

    def _install_log_ids(self) -> None:
        self._factory = _RecordWithTraceIds(logging.getLogRecordFactory())
        logging.setLogRecordFactory(self._factory)


class _RecordWithTraceIds:
    """A log record factory: records made while a span is current carry its ids (the message
    gains `` trace_id=<32 hex> span_id=<16 hex>``, whatever the handler's format)."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, *args, **kwargs) -> logging.LogRecord:
        from opentelemetry import trace

        record = self.previous(*args, **kwargs)
        context = trace.get_current_span().get_span_context()
        if context.is_valid and not hasattr(record, "otelTraceID"):  # once, however many servers trace
            record.otelTraceID = trace.format_trace_id(context.trace_id)
            record.otelSpanID = trace.format_span_id(context.span_id)
            if isinstance(record.msg, str):
                record.msg = f"{record.msg} trace_id={record.otelTraceID} span_id={record.otelSpanID}"
        return record
