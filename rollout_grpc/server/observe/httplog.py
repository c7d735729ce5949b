"""Debug log of engine HTTP calls: one line per call (method, URL, status, duration).

An `aiohttp.TraceConfig` on the replica's shared session, so every engine call (generate, abort,
pause, probes) is covered without touching the engine adapter. The lines are logged at debug level
(`--log-level debug`); at other levels structlog drops them before any formatting.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import aiohttp
import structlog

from rollout_grpc.server.facade.calls import CURRENT_CALL

log = structlog.get_logger("rollout_grpc.server.engine_http")


async def _start(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object) -> None:
    ctx.log_started = time.monotonic()


def _request_id() -> str | None:
    record = CURRENT_CALL.get()
    return record.request_id if record is not None and record.request_id else None


async def _end(
    session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams
) -> None:
    log.debug(
        "engine_call",
        method=params.method,
        url=str(params.url),
        status=params.response.status,
        ms=round((time.monotonic() - ctx.log_started) * 1000, 2),
        request_id=_request_id(),
    )


async def _error(
    session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceRequestExceptionParams
) -> None:
    log.debug(
        "engine_call",
        method=params.method,
        url=str(params.url),
        error=f"{type(params.exception).__name__}: {params.exception}",
        ms=round((time.monotonic() - ctx.log_started) * 1000, 2),
        request_id=_request_id(),
    )


def engine_calls_logged() -> bool:
    """True when this process keeps debug lines (`logs.configure`), so the trace config pays."""
    is_enabled_for = getattr(structlog.get_logger().bind(), "is_enabled_for", None)
    return True if is_enabled_for is None else bool(is_enabled_for(logging.DEBUG))


def engine_call_logging() -> aiohttp.TraceConfig:
    """The trace config that logs each engine call at debug level."""
    config = aiohttp.TraceConfig()
    config.on_request_start.append(_start)
    config.on_request_end.append(_end)
    config.on_request_exception.append(_error)
    return config
