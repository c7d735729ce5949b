"""structlog configuration: JSON lines (orjson) for collectors, readable lines on a terminal.

`--log-format auto` (the default) picks by where the lines go: a terminal gets structlog's console
renderer, anything else (a pipe, a file, a container runtime's log driver) gets JSON lines.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import orjson
import structlog

#: `--log-format` values.
FORMATS = ("auto", "json", "console")


def resolve_format(fmt: str, stream: TextIO) -> str:
    """ "json" or "console": `fmt` itself, or for "auto" what suits `stream` (console on a TTY)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    try:
        return "console" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # a closed or file-less stream
        return "json"


def configure(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Configure structlog once for the process; lines go to `stream` (standard error)."""
    out = stream or sys.stderr
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    if resolve_format(fmt, out) == "json":
        processors.append(structlog.processors.JSONRenderer(serializer=orjson.dumps))
        factory: structlog.types.WrappedLogger = structlog.BytesLoggerFactory(out.buffer)
    else:
        # Colours only on a terminal, and never under NO_COLOR (https://no-color.org).
        colors = out.isatty() and "NO_COLOR" not in os.environ
        processors.append(structlog.dev.ConsoleRenderer(colors=colors))
        factory = structlog.PrintLoggerFactory(out)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
