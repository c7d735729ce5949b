"""Fleet control: abort, pause, resume and the server-info view, across all engines.

Engines are shared by every service replica, so these operations act on the engines themselves
(vLLM's `/pause`, `/resume`, `/inference/v1/abort_requests`, `/update_weight_version`): whichever
replica receives the call, the streams served by the other replicas end too, because their engine
calls end with `finish_reason: "abort"`. Pause and abort-all always end in resume when asked to
(try/finally with bounded retries): a paused vLLM holds every new request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from rollout_grpc.server.engines import EngineHandle, EnginePool
from rollout_grpc.server.errors import InvalidArgument
from rollout_grpc.server.inflight import InFlight, InFlightRegistry
from rollout_grpc.server.rollout import Rollout
from rollout_grpc.server.vllm import EngineError, engine_request_id

log = structlog.get_logger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(slots=True)
class AbortResult:
    """How many local generations were aborted, unknown ids, engines that failed."""

    aborted: int = 0
    unknown_request_ids: list[str] = field(default_factory=list)
    engine_errors: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class FleetResult:
    """Engines that did what was asked, and those that did not (with the error)."""

    ok: list[str] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)


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


class Control:
    """Abort / pause / resume / info over the engine pool."""

    def __init__(
        self,
        pool: EnginePool,
        registry: InFlightRegistry,
        rollout: Rollout,
        *,
        resume_attempts: int = 3,
        peer_abort: Callable[[str | None, int | None], Awaitable[int]] | None = None,
    ) -> None:
        self._pool = pool
        self._registry = registry
        self._rollout = rollout
        self._resume_attempts = resume_attempts
        self._peer_abort = peer_abort

    # ----------------------------------------------------------------------------- helpers

    async def _each(
        self,
        engines: Sequence[EngineHandle],
        action: Callable[[EngineHandle], Awaitable[object]],
    ) -> FleetResult:
        """Run `action` on every engine concurrently and sort the outcomes."""
        outcomes = await asyncio.gather(*(action(e) for e in engines), return_exceptions=True)
        result = FleetResult()
        for engine, outcome in zip(engines, outcomes, strict=True):
            if isinstance(outcome, EngineError):
                result.errors.append((engine.url, outcome.message))
            elif isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                result.errors.append((engine.url, f"{type(outcome).__name__}"))
                log.error("engine_control_failed", engine=engine.url, error=repr(outcome))
            else:
                result.ok.append(engine.url)
        return result

    async def _resume_one(self, engine: EngineHandle) -> None:
        """POST /resume with bounded retries; the last error propagates."""
        for attempt in range(1, self._resume_attempts + 1):
            try:
                await engine.client.resume()
                return
            except EngineError:
                if attempt == self._resume_attempts:
                    raise
                await asyncio.sleep(0.05 * 2**attempt)

    # ----------------------------------------------------------------------------- abort

    async def abort_all(self) -> AbortResult:
        """Abort everything in flight on every engine: pause(abort), then always resume."""
        self._rollout.begin_abort_all()
        local = self._registry.all()
        for entry in local:
            entry.request_abort("abort all")
        engines = self._pool.engines
        result = AbortResult(aborted=len(local))
        try:
            paused = await self._each(engines, lambda e: e.client.pause("abort"))
            result.engine_errors.extend(paused.errors)
        finally:
            try:
                resumed = await self._each(engines, self._resume_one)
                result.engine_errors.extend((url, f"not resumed: {err}") for url, err in resumed.errors)
            finally:
                self._rollout.end_abort_all()
        log.info("abort_all", aborted=result.aborted, engine_errors=len(result.engine_errors))
        return result

    async def abort_ids(self, request_ids: Sequence[str]) -> AbortResult:
        """Abort generations by request id, on every engine (ids may belong to other replicas)."""
        if not request_ids or any(not rid for rid in request_ids):
            raise InvalidArgument("request_ids.ids", "must list at least one non-empty request id")
        found, unknown = self._registry.select(request_ids)
        for entry in found:
            entry.request_abort("abort by id")
        # Engine ids of local generations, plus the ids other replicas would use for the unknown
        # ones (first call and failover calls), sent to every engine.
        engine_ids = [eid for entry in found for eid in entry.engine_request_ids]
        for rid in unknown:
            engine_ids.append(engine_request_id(rid))
            engine_ids.extend(
                engine_request_id(rid, n) for n in range(1, self._rollout.config.max_engine_attempts)
            )
        result = AbortResult(aborted=len(found), unknown_request_ids=list(unknown))
        if engine_ids:
            outcome = await self._each(self._pool.engines, lambda e: e.client.abort_requests(engine_ids))
            result.engine_errors.extend(outcome.errors)
        return result

    async def abort_matching(
        self, *, session_id: str | None = None, group_index: int | None = None
    ) -> AbortResult:
        """Abort the generations of a session or prompt group (here, and on peers when configured)."""
        if session_id is not None and not session_id:
            raise InvalidArgument("session_id", "must not be empty")
        entries = self._registry.matching(session_id=session_id, group_index=group_index)
        result = await self._abort_entries(entries)
        if self._peer_abort is not None:
            result.aborted += await self._peer_abort(session_id, group_index)
        return result

    async def abort_local(
        self, *, session_id: str | None = None, group_index: int | None = None
    ) -> AbortResult:
        """Abort matching generations of this replica only (the target of a peer's forward)."""
        entries = self._registry.matching(session_id=session_id, group_index=group_index)
        return await self._abort_entries(entries)

    async def _abort_entries(self, entries: list[InFlight]) -> AbortResult:
        result = AbortResult(aborted=len(entries))
        by_engine: dict[str, tuple[EngineHandle, list[str]]] = {}
        for entry in entries:
            entry.request_abort("abort by session or group")
            if entry.engine is not None and entry.engine_request_ids:
                by_engine.setdefault(entry.engine.url, (entry.engine, []))[1].append(
                    entry.engine_request_ids[-1]
                )
        if by_engine:
            groups = list(by_engine.values())
            outcome = await self._each(
                [engine for engine, _ in groups],
                lambda e: e.client.abort_requests(by_engine[e.url][1]),
            )
            result.engine_errors.extend(outcome.errors)
        return result

    # ----------------------------------------------------------------------------- pause / resume

    async def pause(self, mode: str) -> FleetResult:
        """Pause every engine (`abort`, `wait` or `keep`)."""
        if mode not in PAUSE_MODES:
            raise InvalidArgument("mode", f"must be one of ABORT, WAIT, KEEP; got {mode!r}")
        if mode == "abort":
            for entry in self._registry.all():
                entry.request_abort("pause abort")
        # `wait` blocks until the engine drained: no timeout of our own.
        timeout = None if mode == "wait" else 30.0
        result = await self._each(self._pool.engines, lambda e: e.client.pause(mode, timeout=timeout))
        log.info("pause", mode=mode, paused=len(result.ok), errors=len(result.errors))
        return result

    async def resume(self, weight_version: str | None) -> FleetResult:
        """Relabel the weights (when given), then resume every engine — resume happens regardless."""
        engines = self._pool.engines
        errors: list[tuple[str, str]] = []
        if weight_version is not None:
            if not weight_version:
                raise InvalidArgument("weight_version", "must not be empty when set")
            relabel = await self._each(engines, lambda e: e.client.update_weight_version(weight_version))
            errors.extend((url, f"weight version not set: {err}") for url, err in relabel.errors)
            for engine in engines:
                if engine.url in relabel.ok:
                    engine.weight_version = weight_version
        resumed = await self._each(engines, self._resume_one)
        resumed.errors = errors + resumed.errors
        log.info("resume", weight_version=weight_version, resumed=len(resumed.ok), errors=len(resumed.errors))
        return resumed

    # ----------------------------------------------------------------------------- info

    async def engine_statuses(self) -> list[EngineStatus]:
        """Every engine with its paused state and weight version (unknown ones reported as such)."""

        async def one(engine: EngineHandle) -> EngineStatus:
            paused, version = False, engine.weight_version
            if engine.healthy:
                try:
                    paused, version = await asyncio.gather(
                        engine.client.is_paused(), engine.client.weight_version()
                    )
                    engine.weight_version = version
                except EngineError as exc:
                    log.warning("engine_info_failed", engine=engine.url, error=exc.message)
            if not engine.model and engine.healthy:
                try:
                    models = await engine.client.models()
                    engine.model = str(models[0].get("id", "")) if models else ""
                except EngineError:
                    pass
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
