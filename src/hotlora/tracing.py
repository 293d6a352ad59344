"""A request's trace as the engine sees it: spans opened under that request's own span, or nothing.

The engine must run without OpenTelemetry installed and cost nothing when tracing is off, so it
never imports it: every request carries a ``Trace``. ``NO_TRACE`` (the default) opens no span;
the server hands in a ``SpanTrace`` built on its own tracer and the request's root span
(``hotlora.server.tracing``). Spans are opened with the OpenTelemetry API's own calls; this module
only remembers, per request, which span the next one hangs under, because the request crosses
threads (the event loop, a prepare thread, the worker) where OpenTelemetry's implicit
thread-local context does not follow it.

A bottom-layer module (like ``errors``): the engine and the server both import it.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from typing import Iterator, Sequence


class Trace:
    """No tracing: every span is a no-op. The base of the traces that do record."""

    recording = False

    @contextmanager
    def span(self, name: str, **attributes) -> Iterator[None]:
        yield None

    def record(self, name: str, start_ns: int, end_ns: int, **attributes) -> None:
        """A span for an interval measured elsewhere (a queue wait: it began on another thread)."""

    def event(self, name: str, **attributes) -> None:
        """A point in time on the current span."""


NO_TRACE = Trace()


class SpanTrace(Trace):
    """Spans of one request, under ``context`` (an OpenTelemetry ``Context`` holding the request's
    root span), made by ``tracer``. Used by one thread at a time, as the request moves along."""

    recording = True

    def __init__(self, tracer, context):
        self._tracer = tracer
        self._context = context

    @contextmanager
    def span(self, name: str, **attributes) -> Iterator[object]:
        from opentelemetry import trace  # only reached when the server built this trace: installed

        parent = self._context
        with self._tracer.start_as_current_span(name, context=parent, attributes=attributes or None) as span:
            self._context = trace.set_span_in_context(span, parent)  # nested spans hang under this one
            try:
                yield span
            finally:
                self._context = parent

    def record(self, name: str, start_ns: int, end_ns: int, **attributes) -> None:
        span = self._tracer.start_span(name, context=self._context, attributes=attributes or None,
                                       start_time=start_ns)
        span.end(end_time=end_ns)

    def event(self, name: str, **attributes) -> None:
        from opentelemetry import trace

        trace.get_current_span(self._context).add_event(name, attributes=attributes or None)


class Together(Trace):
    """Several requests sharing one forward batch: each span is opened in every request's trace."""

    def __init__(self, traces: Sequence[Trace]):
        self.traces = [t for t in traces if t.recording]
        self.recording = bool(self.traces)

    @contextmanager
    def span(self, name: str, **attributes) -> Iterator[None]:
        with ExitStack() as stack:
            for trace in self.traces:
                stack.enter_context(trace.span(name, **attributes))
            yield None

    def record(self, name: str, start_ns: int, end_ns: int, **attributes) -> None:
        for trace in self.traces:
            trace.record(name, start_ns, end_ns, **attributes)

    def event(self, name: str, **attributes) -> None:
        for trace in self.traces:
            trace.event(name, **attributes)


def together(traces: Sequence[Trace]) -> Trace:
    joined = Together(traces)
    return joined if joined.recording else NO_TRACE


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as wall-clock nanoseconds (span timestamps are wall clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
