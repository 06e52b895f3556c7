"""OpenTelemetry traces: a span per command with its child work.

Spans go through the OpenTelemetry API. With no SDK configured they are no-ops (the cost is a
function call), so nothing is collected or exported unless someone asks: an application that sets
its own TracerProvider, or the CLI when the standard ``OTEL_TRACES_EXPORTER`` variable names an
exporter.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

__all__ = ["configure_from_environment", "tracer"]

logger = logging.getLogger(__name__)


class _Tracer:
    """``start_as_current_span`` of the OpenTelemetry API, without its cost when nothing
    collects: with no provider set, the API's no-op span still enters and leaves a context,
    ~8 us a span, and a command opens eight. A provider set later (by an application, or
    ``configure_from_environment``) is seen at the next span."""

    def __init__(self, name: str) -> None:
        self._tracer = trace.get_tracer(name)
        self._no_span = contextlib.nullcontext(trace.INVALID_SPAN)

    def start_as_current_span(
        self, name: str, *, attributes: Mapping[str, AttributeValue] | None = None,
    ) -> AbstractContextManager[trace.Span]:
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return self._no_span
        return self._tracer.start_as_current_span(name, attributes=attributes)


tracer = _Tracer("corral")


def configure_from_environment() -> bool:
    """Install an SDK tracer provider when ``OTEL_TRACES_EXPORTER`` asks for one.

    Supports ``console`` and ``otlp`` (with ``opentelemetry-exporter-otlp`` installed). Returns
    True when tracing was switched on.
    """
    wanted = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not wanted or wanted == "none":
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        logger.warning("OTEL_TRACES_EXPORTER=%s but opentelemetry-sdk is not installed "
                       "(pip install 'corral[otel]'); traces are off", wanted)
        return False
    exporter: object
    if wanted == "console":
        exporter = ConsoleSpanExporter()
    elif wanted == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            logger.warning("OTEL_TRACES_EXPORTER=otlp needs opentelemetry-exporter-otlp; "
                           "traces are off")
            return False
        exporter = OTLPSpanExporter()
    else:
        logger.warning("unsupported OTEL_TRACES_EXPORTER=%s (use console or otlp)", wanted)
        return False
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "corral")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))  # type: ignore[arg-type]
    trace.set_tracer_provider(provider)
    return True
