"""structlog configuration: the only place that calls structlog.configure.

Tracebacks never show local variables: structlog's defaults (rich console tracebacks, dict tracebacks in
JSON) would print every frame's locals, and a request handler's locals hold the settings (API key) and
the raw request body.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from mlx_dspark.application.settings import TelemetrySettings


def _console_exceptions() -> structlog.typing.ExceptionRenderer:
    try:
        import rich  # noqa: F401  (rich is optional for structlog)
    except ImportError:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)


def configure_logging(settings: TelemetrySettings) -> None:
    """Console lines on a terminal, JSON otherwise, on stderr; one shared format for stdlib loggers too.

    Loggers are not cached: module-level loggers would otherwise keep the first configuration (and its
    output stream) for good, and a later configure (a test, a launcher moving logs to a file) would not apply.
    """
    out = sys.stderr
    level = getattr(logging, settings.log_level.upper(), logging.INFO)
    json_logs = settings.json_logs if settings.json_logs is not None else not out.isatty()
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor
    if json_logs:
        shared.append(structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False)))
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(exception_formatter=_console_exceptions())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processor=renderer, foreign_pre_chain=shared))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(level, logging.WARNING))
