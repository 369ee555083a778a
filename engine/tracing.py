"""OpenTelemetry request tracing: off unless the standard OTEL_* environment asks for it.

On when OTEL_TRACES_EXPORTER names an exporter (`otlp` or `console`) or an OTLP
endpoint is set (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT);
the OTLP exporter (HTTP/protobuf) reads its other OTEL_EXPORTER_OTLP_* settings itself
and OTEL_SERVICE_NAME names the service. A process that installed an SDK
TracerProvider of its own (a test's in-memory exporter) gets the spans there.

A request's W3C trace context (`traceparent`, `tracestate`) continues from the caller:
the ingress opens a SERVER span per HTTP request as the caller's child, and sends its
own context to the engine in EngineCoreRequest.trace_headers; when the request finishes
the engine records `llm_request` (vLLM's span and gen_ai.* attributes) as the ingress
span's child, with children `queue`, `prefill` and `decode` timed on the engine's clock.

Off, nothing here is imported by the request path: a request carries no trace headers
and costs the engine one None check.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Mapping

logger = logging.getLogger(__name__)
TRACE_HEADERS = ("traceparent", "tracestate")
_lock = threading.Lock()
_tracer = None
_failed = False  # the tracer could not be set up: tracing stays off in this process


def enabled() -> bool:
    """Whether the environment asks for traces (read each time: tests change it)."""
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none" or _failed:
        return False
    return bool(exporter or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def tracer():
    """The process's tracer, made on first use: the SDK provider already installed, or
    one exporting as OTEL_TRACES_EXPORTER says (a batch processor: spans leave off the
    request path). None if that cannot be set up (logged once; tracing goes off)."""
    global _tracer, _failed
    with _lock:
        if _tracer is None and not _failed:
            try:
                _tracer = _make_tracer()
            except Exception as exc:  # a bad OTEL_* setting must not fail requests
                _failed = True
                logger.error("tracing off: %s", exc)
        return _tracer


def _make_tracer():
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME", "flotilla")}))
        provider.add_span_processor(BatchSpanProcessor(_exporter()))
        trace.set_tracer_provider(provider)
    return provider.get_tracer("flotilla")


def _exporter():
    kind = (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(",")[0].strip().lower()
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )
        return OTLPSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: Flotilla exports traces with otlp "
                     "or console")


def _context(headers: Mapping[str, str] | None):
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )
    carrier = {k: headers[k] for k in TRACE_HEADERS if headers and k in headers}
    return TraceContextTextMapPropagator().extract(carrier)


def start_http_span(name: str, headers: Mapping[str, str], attributes: dict[str, Any]):
    """A SERVER span for one HTTP request, the caller's child if it sent a traceparent
    (None when tracing could not be set up)."""
    from opentelemetry.trace import SpanKind
    t = tracer()
    if t is None:
        return None
    return t.start_span(name, context=_context(headers), kind=SpanKind.SERVER,
                        attributes=attributes)


def headers_of(span) -> dict[str, str]:
    """The W3C headers that make the engine's span a child of `span`."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def record_request(trace_headers: dict[str, str], attributes: dict[str, Any],
                   queued: float, scheduled: float, first_token: float, end: float) -> None:
    """The engine's `llm_request` span and its phases, from monotonic times taken in
    the engine (converted to wall-clock nanoseconds here, at the end)."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind
    offset = time.time_ns() - int(time.monotonic() * 1e9)

    def ns(t: float) -> int:
        return offset + int(t * 1e9)
    t = tracer()
    if t is None:
        return
    span = t.start_span("llm_request", context=_context(trace_headers), kind=SpanKind.SERVER,
                        attributes=attributes, start_time=ns(queued))
    inside = trace.set_span_in_context(span)
    for name, start, stop in (("queue", queued, scheduled), ("prefill", scheduled, first_token),
                              ("decode", first_token, end)):
        t.start_span(name, context=inside, start_time=ns(start)).end(end_time=ns(stop))
    span.end(end_time=ns(end))
