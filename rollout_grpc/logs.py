"""structlog configuration: JSON lines (orjson) in production, readable lines on a terminal."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog


def configure(level: str = "info", fmt: str = "json") -> None:
    """Configure structlog once for the process."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    if fmt == "json":
        processors.append(structlog.processors.JSONRenderer(serializer=orjson.dumps))
        factory: structlog.types.WrappedLogger = structlog.BytesLoggerFactory(sys.stderr.buffer)
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
