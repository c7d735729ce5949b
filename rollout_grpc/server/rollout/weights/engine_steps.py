"""The engine side of a weight operation: one call on every engine under the control deadline,
each engine's current label, the staged load and the labelling of the engines that loaded.

Kept apart from the use case (`updates.py`) so that a checkpoint load, a distributed receive and a
memory release share one way of calling the fleet, of timing each engine out and of describing
its failure, whatever the operation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import structlog

from rollout_grpc.server.engines.api import ControlAction, EngineError, WeightAction
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout.control import ControlFailure, FleetResult, describe_failure
from rollout_grpc.server.rollout.weights.values import (
    EngineOutcome,
    Loader,
    StepError,
    WeightUpdate,
    WeightUpdateResult,
)

log = structlog.get_logger("rollout_grpc.server.rollout.weights")


class EngineSteps:
    """The calls a weight operation makes on the engines of the pool."""

    def __init__(self, pool: EnginePool, *, deadline_s: float, load_timeout_s: float) -> None:
        self._pool = pool
        self._deadline_s = deadline_s
        self._load_timeout_s = load_timeout_s

    async def each(
        self,
        engines: Sequence[EngineHandle],
        action: WeightAction,
        call: Callable[[EngineHandle], Awaitable[None]],
    ) -> FleetResult:
        """`call` on every engine concurrently, each within the control deadline."""
        result = FleetResult()

        async def one(engine: EngineHandle) -> None:
            route = engine.client.weight_route(action)
            try:
                async with asyncio.timeout(self._deadline_s):
                    await call(engine)
            except TimeoutError:
                result.fail(
                    engine.url, ControlFailure.TIMEOUT, f"{route}: no answer within {self._deadline_s:g} s"
                )
                return
            except EngineError as exc:
                kind, message = describe_failure(exc, route, engine.client.missing_route_hint)
                result.fail(engine.url, kind, message)
                return
            result.ok.append(engine.url)

        await asyncio.gather(*(one(e) for e in engines if e.healthy))
        return result

    async def labels(self) -> dict[str, str]:
        """Each healthy engine's current label (asked now: another client may have relabelled)."""

        async def ask(engine: EngineHandle) -> tuple[str, str]:
            try:
                self._pool.relabel(
                    engine, await asyncio.wait_for(engine.client.weight_version(), self._deadline_s)
                )
            except (EngineError, TimeoutError) as exc:
                log.warning("weight_version_unknown", engine=engine.url, error=str(exc))
            return engine.url, engine.weight_version

        return dict(await asyncio.gather(*(ask(e) for e in self._pool.engines if e.healthy)))

    def rotation(self) -> list[EngineHandle]:
        return [e for e in self._pool.engines if e.usable]

    async def load_and_label(
        self,
        update: WeightUpdate,
        loader: Loader,
        targets: Sequence[EngineHandle],
        paused: FleetResult,
        result: WeightUpdateResult,
    ) -> None:
        """Load on the paused targets (one first when `loader.staged`), then label those that loaded."""
        pause_errors = dict(paused.errors)
        outcomes = {e.url: EngineOutcome(e.url, updated=False) for e in targets}
        result.engines = list(outcomes.values())
        ready = [e for e in targets if e.url in paused.ok]
        for engine in targets:
            if engine.url in pause_errors:
                outcomes[engine.url].error = f"not paused, so not loaded: {pause_errors[engine.url]}"
        loop = asyncio.get_running_loop()
        begin = loop.time()
        first, rest = (ready[:1], ready[1:]) if loader.staged else (ready, [])
        loaded = await self._load_all(first, loader, outcomes)
        if rest and loaded:
            loaded += await self._load_all(rest, loader, outcomes)
        elif rest:
            for engine in rest:
                outcomes[engine.url].error = "not loaded: the first engine's load failed (staged update)"
        result.load_s = loop.time() - begin
        await self._label(loaded, update.weight_version, outcomes)

    async def _load_all(
        self, engines: Sequence[EngineHandle], loader: Loader, outcomes: dict[str, EngineOutcome]
    ) -> list[EngineHandle]:
        async def one(engine: EngineHandle) -> bool:
            route = engine.client.weight_route(loader.action)
            try:
                async with asyncio.timeout(self._load_timeout_s):
                    await loader.load(engine)
            except TimeoutError:
                outcomes[engine.url].error = f"{route}: no answer within {self._load_timeout_s:g} s"
                outcomes[engine.url].load_failed = True
                return False
            except StepError as exc:  # joining the group failed: the weights were not touched
                _, message = describe_failure(
                    exc.cause, engine.client.weight_route(exc.action), engine.client.missing_route_hint
                )
                outcomes[engine.url].error = message
                return False
            except EngineError as exc:
                _, message = describe_failure(exc, route, engine.client.missing_route_hint)
                outcomes[engine.url].error = message
                outcomes[engine.url].load_failed = True
                return False
            return True

        done = await asyncio.gather(*(one(e) for e in engines))
        return [e for e, ok in zip(engines, done, strict=True) if ok]

    async def _label(
        self, engines: Sequence[EngineHandle], version: str, outcomes: dict[str, EngineOutcome]
    ) -> None:
        async def one(engine: EngineHandle) -> None:
            try:
                async with asyncio.timeout(self._deadline_s):
                    await engine.client.update_weight_version(version)
            except (EngineError, TimeoutError) as exc:
                route = engine.client.control_route(ControlAction.UPDATE_WEIGHT_VERSION)
                detail = (
                    exc.message
                    if isinstance(exc, EngineError)
                    else f"no answer within {self._deadline_s:g} s"
                )
                outcomes[engine.url].error = f"loaded, but the version was not set ({route}: {detail})"
                return
            self._pool.relabel(engine, version)
            outcomes[engine.url].updated = True

        await asyncio.gather(*(one(e) for e in engines))
