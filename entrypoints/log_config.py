"""structlog configuration: the only place that calls structlog.configure.

Tracebacks never show local variables: structlog's defaults (rich console tracebacks, dict tracebacks in
JSON) would print every frame's locals, and a request handler's locals hold the settings (API key) and
the raw request body. Every string value is bounded and escaped (`bound_values`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from mlx_dspark.application.settings import TelemetrySettings
from mlx_dspark.domain.errors import clipped

LOG_VALUE_CHARS = 1000  # far above any field of ours; a caller's megabyte string stops here


def _bounded(value: Any) -> Any:
    if isinstance(value, str):
        return clipped(value, LOG_VALUE_CHARS)
    if isinstance(value, dict):
        return {k: _bounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_bounded(v) for v in value]
    return value


def bound_values(_: Any, __: str, event_dict: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """Every string of a line cut to LOG_VALUE_CHARS with control characters escaped: a value a caller sent
    (a model name, a header) can neither flood the log nor forge a line of its own on a console."""
    return {k: v if k == "exc_info" else _bounded(v) for k, v in event_dict.items()}


def _console_exceptions() -> structlog.typing.ExceptionRenderer:
    try:
        import rich  # noqa: F401  (rich is optional for structlog)
    except ImportError:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)


LIBRARY_LOGGERS = ("huggingface_hub",)  # they add a stderr handler of their own


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
        bound_values,
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
    # Libraries that print through a handler of their own and propagate too wrote each line twice (a download's
    # every retry): their lines go through the one structured handler only.
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).handlers = []


def library_logging() -> None:
    """The Python API's logging when its caller has configured none: warnings and errors on stderr, bounded.

    structlog unconfigured prints every level to stdout, which from a library meant a debug line per decode
    round in the caller's output. A caller who configured structlog keeps their configuration; the stdlib
    root logger is never touched here (it is the application's, not a library's)."""
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            bound_values,
            structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
