"""structlog configuration: the only place that calls structlog.configure."""

from __future__ import annotations

import logging
import sys

import structlog

from mlx_dspark.application.settings import TelemetrySettings


def configure_logging(settings: TelemetrySettings, *, cache: bool = True) -> None:
    """Console lines on a terminal, JSON otherwise; one shared format for stdlib loggers too."""
    level = getattr(logging, settings.log_level.upper(), logging.INFO)
    json_logs = settings.json_logs if settings.json_logs is not None else not sys.stderr.isatty()
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor
    if json_logs:
        shared.append(structlog.processors.dict_tracebacks)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=cache,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processor=renderer, foreign_pre_chain=shared))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(level, logging.WARNING))
