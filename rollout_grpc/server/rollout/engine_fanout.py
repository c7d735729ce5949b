"""Asking every engine at once under one deadline, and what each answered (fleet control's engine side).

`Control` (control.py) runs every engine action (abort by engine id, pause, resume, relabel) through
`fan_out`: the healthy engines are asked concurrently, the unhealthy ones reported as skipped,
and each failure is kept with its kind and an actionable message (never a raw engine body).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollout_grpc.server.domain.errors import FailedPrecondition, Unavailable
from rollout_grpc.server.engines.api import (
    ControlAction,
    EngineError,
    EngineHealth,
    EngineRejected,
    EngineRequestFailed,
)
from rollout_grpc.server.engines.pool import EngineHandle

log = structlog.get_logger(__name__)


class ControlFailure(enum.Enum):
    """Why an engine did not do what was asked."""

    NOT_FOUND = "not_found"  # 404: the route is off (dev mode) — a deployment problem
    REJECTED = "rejected"  # another HTTP error
    UNREACHABLE = "unreachable"  # connection refused or broken
    TIMEOUT = "timeout"  # no answer within the deadline (hung engine)
    SKIPPED = "skipped"  # marked unhealthy by the health probe: not asked
    OTHER = "other"


@dataclass(slots=True)
class FleetResult:
    """Engines that did what was asked, and those that did not (with the error and its kind)."""

    ok: list[str] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    kinds: list[ControlFailure] = field(default_factory=list)

    def fail(self, url: str, kind: ControlFailure, message: str) -> None:
        """Record one engine's failure."""
        self.errors.append((url, message))
        self.kinds.append(kind)

    def extend(self, other: FleetResult, prefix: str = "") -> None:
        """Add another fan-out's failures (e.g. resume after pause), messages prefixed."""
        for (url, message), kind in zip(other.errors, other.kinds, strict=True):
            self.fail(url, kind, prefix + message)

    def raise_if_none_ok(self, what: str) -> None:
        """Fail the RPC when engines were asked and none did it, with every engine's reason."""
        if self.ok or not self.errors:
            return
        reasons = "; ".join(f"{url}: {message}" for url, message in self.errors)
        text = f"no engine could {what} ({reasons})"
        if ControlFailure.NOT_FOUND in self.kinds:
            raise FailedPrecondition(text)
        raise Unavailable(text)


def describe_failure(
    exc: BaseException, route: str, missing_route_hint: str = ""
) -> tuple[ControlFailure, str]:
    """An engine failure as (kind, actionable message) — never a raw `{"detail":...}` body.

    `missing_route_hint` is the engine kind's advice for a route that answers 404
    (`EngineAdapter.missing_route_hint`)."""
    if isinstance(exc, EngineRejected):
        if exc.not_found:
            return (
                ControlFailure.NOT_FOUND,
                f"{route} answered 404: {missing_route_hint or 'route not served'}",
            )
        return ControlFailure.REJECTED, f"{route} was refused: {exc.message}"
    if isinstance(exc, EngineRequestFailed):
        return ControlFailure.REJECTED, f"{route} failed on the engine: {exc.message}"
    if isinstance(exc, EngineError):
        return ControlFailure.UNREACHABLE, f"{route}: engine unreachable ({exc.message})"
    return ControlFailure.OTHER, f"{route} failed ({type(exc).__name__})"


def split_healthy(engines: Sequence[EngineHandle]) -> tuple[list[EngineHandle], FleetResult]:
    """(engines to ask, a result listing the unhealthy ones as skipped)."""
    result = FleetResult()
    asked: list[EngineHandle] = []
    for engine in engines:
        if engine.healthy:
            asked.append(engine)
        else:
            reason = engine.last_error or "no answer"
            result.fail(engine.url, ControlFailure.SKIPPED, f"skipped: marked unhealthy ({reason})")
    return asked, result


#: Seconds before a fan-out's deadline that engines which have not answered yet are probed, so
#: that a TIMEOUT says whether the engine is alive and busy or does not answer at all.
LIVENESS_PROBE_S = 2.0


def _no_answer(where: str, wait: str, probe: asyncio.Future[EngineHealth] | None) -> str:
    """The TIMEOUT message of an engine call, from the health probe run before the deadline."""
    alive = (
        probe is not None
        and probe.done()
        and not probe.cancelled()
        and probe.exception() is None
        and bool(probe.result())
    )
    if alive:
        return (
            f"{where}: no answer within {wait}, yet the engine passes its health probe: busy, not "
            "hung (an engine may run this only after its step in progress, and a long prefill on "
            "a loaded CPU takes seconds); raise --control-deadline"
        )
    return f"{where}: no answer within {wait} and none to a health probe either (engine hung?)"


class StepFailed(Exception):
    """An engine failed at `action` (one step of a multi-step per-engine action)."""

    def __init__(self, action: ControlAction, cause: BaseException, detail: str = "") -> None:
        super().__init__(action)
        self.action = action
        self.detail = detail
        self.cause = cause


async def fan_out(
    engines: Sequence[EngineHandle],
    action: Callable[[EngineHandle], Awaitable[object]],
    *,
    route: ControlAction,
    detail: str = "",
    timeout_s: float | None,
) -> FleetResult:
    """Run `action` on every healthy engine concurrently, all of it within `timeout_s`.

    Unhealthy engines are not asked (reported as skipped); engines still busy at the deadline
    have their calls cancelled and are reported as TIMEOUT, each with what a health probe run
    in the last seconds before the deadline found: an engine that answers it is busy, not hung
    (vLLM runs a pause only between engine steps, after the step in progress — a long prefill,
    an image on a loaded CPU, takes seconds), and the fix is a longer `--control-deadline`.
    """
    asked, result = split_healthy(engines)
    if not asked:
        return result
    tasks = [asyncio.ensure_future(action(engine)) for engine in asked]
    probes: dict[asyncio.Future[Any], asyncio.Future[EngineHealth]] = {}
    try:
        pending = await _wait_probing(asked, tasks, timeout_s, probes)
    finally:
        for task in tasks:
            task.cancel()
        for probe in probes.values():
            probe.cancel()
    if pending:
        await asyncio.wait(pending)
    for engine, task in zip(asked, tasks, strict=True):
        client = engine.client
        if task in pending or task.cancelled():
            wait = f"{timeout_s:.1f} s" if timeout_s is not None else "the deadline"
            where = client.control_route(route) + detail
            result.fail(engine.url, ControlFailure.TIMEOUT, _no_answer(where, wait, probes.get(task)))
            continue
        exc = task.exception()
        if exc is None:
            result.ok.append(engine.url)
            continue
        if isinstance(exc, StepFailed):
            step, cause = client.control_route(exc.action) + exc.detail, exc.cause
        else:
            step, cause = client.control_route(route) + detail, exc
        kind, message = describe_failure(cause, step, client.missing_route_hint)
        if kind is ControlFailure.OTHER:
            log.error("engine_control_failed", engine=engine.url, route=step, error=repr(cause))
        result.fail(engine.url, kind, message)
    return result


async def _wait_probing(
    asked: Sequence[EngineHandle],
    tasks: Sequence[asyncio.Future[Any]],
    timeout_s: float | None,
    probes: dict[asyncio.Future[Any], asyncio.Future[EngineHealth]],
) -> set[asyncio.Future[Any]]:
    """Wait for `tasks` until `timeout_s`; the engines still busy `LIVENESS_PROBE_S` before
    it get a health probe (into `probes`) that ends by the deadline too. The pending tasks."""
    if timeout_s is None:
        _, pending = await asyncio.wait(tasks)
        return pending
    timeout_s = max(0.0, timeout_s)
    window = min(LIVENESS_PROBE_S, timeout_s / 2)
    _, pending = await asyncio.wait(tasks, timeout=timeout_s - window)
    if not pending:
        return pending
    for engine, task in zip(asked, tasks, strict=True):
        if task in pending:
            probes[task] = asyncio.ensure_future(engine.client.health(window))
    _, pending = await asyncio.wait(pending, timeout=window)
    return pending


class PauseCountdown:
    """Sets `all_answered` once every engine's pause answered (or failed, or was cancelled)."""

    def __init__(self, engines: int) -> None:
        self._remaining = engines
        self.all_answered = asyncio.Event()
        if engines == 0:
            self.all_answered.set()

    def answered(self) -> None:
        self._remaining -= 1
        if self._remaining == 0:
            self.all_answered.set()


async def turns(n: int) -> None:
    """Let the event loop run `n` times (tasks just created take their first steps)."""
    for _ in range(n):
        await asyncio.sleep(0)
