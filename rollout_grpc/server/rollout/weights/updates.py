"""The UpdateWeights use case: one fleet-wide, serialised weight update (the package's docstring
says the steps and what the caller sees), from a checkpoint directory or a distributed transfer.

This module holds the update's order of steps and its end (the rotation and the resume, the log
line, the error naming each engine); the engine calls are `engine_steps.py`, the fleet lease and
version order `fleet.py`, the transfer plan `transfer.py`, colocated memory `memory.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, Unavailable
from rollout_grpc.server.engines.api import EngineError, MemoryRelease, WeightAction
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout.checkpoint import allowed_path, inspect_checkpoint
from rollout_grpc.server.rollout.control import PAUSE_MODES, Control, FleetResult
from rollout_grpc.server.rollout.weights.engine_steps import EngineSteps
from rollout_grpc.server.rollout.weights.fleet import FleetLease
from rollout_grpc.server.rollout.weights.memory import ColocatedMemory
from rollout_grpc.server.rollout.weights.transfer import TransferPlanner
from rollout_grpc.server.rollout.weights.values import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LOAD_TIMEOUT_S,
    CheckpointSource,
    DistributedSource,
    Loader,
    StepError,
    TransferPlan,
    WeightUpdate,
    WeightUpdateResult,
    check_version,
)
from rollout_grpc.server.state.api import BufferStore
from rollout_grpc.server.state.memory import MemoryStore

log = structlog.get_logger("rollout_grpc.server.rollout.weights")


class WeightUpdates:
    """The UpdateWeights use case over the pool and the fleet control."""

    def __init__(
        self,
        pool: EnginePool,
        control: Control,
        *,
        path_prefixes: Sequence[str] = (),
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        deadline_s: float = 30.0,
        store: BufferStore | None = None,
        holder: str = "this replica",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        #: The fleet's state (lease, version order); one process's memory when not given.
        self._fleet = FleetLease(store or MemoryStore(), holder, lease_ttl_s)
        self._pool = pool
        self._control = control
        self._prefixes = tuple(path_prefixes)
        self._load_timeout_s = load_timeout_s
        self._deadline_s = deadline_s
        self._steps = EngineSteps(pool, deadline_s=deadline_s, load_timeout_s=load_timeout_s)
        #: The version being set by the update in progress, None when none runs.
        self._running: str | None = None
        self._task: asyncio.Task[WeightUpdateResult] | None = None
        #: Every label this replica set, and the last (version, path) for retries.
        self._used: list[str] = []
        self._last: tuple[str, str] | None = None
        self._memory = ColocatedMemory(pool, control, self._steps, self._fleet, self._refuse_if_busy)
        self._transfer = TransferPlanner(
            self._steps, deadline_s=deadline_s, refuse_if_busy=self._refuse_if_busy
        )

    @property
    def running(self) -> str | None:
        """The version an update in progress is setting."""
        return self._running

    async def update(self, update: WeightUpdate) -> WeightUpdateResult:
        """Run one update (see the module docstring); raises the domain errors described there."""
        if update.pause_mode not in PAUSE_MODES:
            raise InvalidArgument("pause_mode", f"must be ABORT, WAIT or KEEP; got {update.pause_mode!r}")
        if isinstance(update.source, CheckpointSource):
            path = allowed_path(update.source.path, self._prefixes)
        else:
            plan = self._transfer.check(update.source)
            path = f"distributed {update.source.group.master_address}:{update.source.group.master_port}"
        if self._running is not None:
            raise FailedPrecondition(
                f"a weight update to {self._running!r} is in progress on this replica; updates are "
                "serialised: retry when it has finished"
            )
        self._refuse_if_busy("update weights")
        self._running = update.weight_version
        try:
            token = await self._fleet.take_lease(f"update weights to {update.weight_version!r}")
        except BaseException:
            self._running = None
            raise
        task = asyncio.ensure_future(
            self._fleet.leased(
                token,
                self._run(update, path)
                if isinstance(update.source, CheckpointSource)
                else self._run_distributed(update, plan),
            )
        )
        self._task = task
        task.add_done_callback(self._finished)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                log.warning(
                    "weight_update_caller_gone",
                    weight_version=update.weight_version,
                    note="the update goes on to its end; weight_update_done/failed says where the fleet is",
                )
            raise

    def _finished(self, task: asyncio.Task[WeightUpdateResult]) -> None:
        self._running = None
        self._task = None
        if not task.cancelled():
            task.exception()  # retrieved: the caller (if still there) got it; the log line has it

    async def close(self) -> None:
        """Let an update in progress finish (its resume), bounded by the load timeout, at shutdown."""
        task = self._task
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), self._load_timeout_s + 2 * self._deadline_s)
            except BaseException:  # its outcome is logged by the task itself
                task.cancel()

    def _refuse_if_busy(self, what: str) -> None:
        if self._running is not None:
            raise FailedPrecondition(
                f"cannot {what} while a weight update to {self._running!r} runs on this replica"
            )

    async def plan_transfer(self, trainer_ranks: int) -> TransferPlan:
        """PlanWeightTransfer (`transfer.py`)."""
        return await self._transfer.plan_transfer(trainer_ranks)

    async def release_memory(self, release: MemoryRelease) -> FleetResult:
        """ReleaseMemory (`memory.py`)."""
        return await self._memory.release_memory(release)

    async def resume_memory(self, tags: tuple[str, ...]) -> tuple[FleetResult, bool]:
        """ResumeMemory (`memory.py`)."""
        return await self._memory.resume_memory(tags)

    # ----------------------------------------------------------------------------- the steps

    async def _run(self, update: WeightUpdate, path: str) -> WeightUpdateResult:
        version = update.weight_version
        loop = asyncio.get_running_loop()
        try:
            summary = await asyncio.to_thread(inspect_checkpoint, path, self._prefixes)
            labels = await self._steps.labels()
            in_rotation = sorted({labels.get(e.url, e.weight_version) for e in self._steps.rotation()} - {""})
            retry = self._last == (version, path)
            if retry:
                targets = [e for e in self._pool.engines if e.weights_problem or labels.get(e.url) != version]
                if not targets:
                    return WeightUpdateResult(version, in_rotation, checkpoint=summary, retry=True)
            else:
                check_version(version, in_rotation, self._used)
                await self._fleet.check_order(version)
                targets = self._pool.engines
            result = WeightUpdateResult(version, in_rotation, checkpoint=summary, retry=retry)
            started = loop.time()
            try:
                paused = await self._control.pause(update.pause_mode)
            except Exception as exc:
                raise Unavailable(f"weight update to {version!r} not started: {exc}") from exc
            loader = Loader(
                WeightAction.LOAD_CHECKPOINT,
                lambda e: e.client.load_checkpoint(path, timeout=self._load_timeout_s),
                staged=not update.all_at_once,
            )
            try:
                await self._steps.load_and_label(update, loader, targets, paused, result)
            finally:
                resumed = await self._resume(result)
                result.paused_s = loop.time() - started
            if any(e.updated for e in result.engines):  # a version no engine took stays free
                self._used.append(version)
                self._last = (version, path)
                await self._fleet.advance_order(version)
        except BaseException as exc:
            log.error("weight_update_failed", weight_version=version, path=path, error=str(exc) or repr(exc))
            raise
        self._report(result, resumed)
        return result

    async def _run_distributed(self, update: WeightUpdate, plan: TransferPlan) -> WeightUpdateResult:
        source = update.source
        assert isinstance(source, DistributedSource)
        version = update.weight_version
        loop = asyncio.get_running_loop()
        try:
            labels = await self._steps.labels()
            in_rotation = sorted({labels.get(e.url, e.weight_version) for e in self._steps.rotation()} - {""})
            check_version(version, in_rotation, self._used)
            await self._fleet.check_order(version)
            offsets = {url: offset for url, offset, _ in plan.engines}
            targets = [e for e in self._pool.engines if e.url in offsets]
            result = WeightUpdateResult(version, in_rotation)
            started = loop.time()
            try:
                paused = await self._control.pause(update.pause_mode)
            except Exception as exc:
                raise Unavailable(f"weight update to {version!r} not started: {exc}") from exc
            joined = (
                self._transfer.joined[1]
                if self._transfer.joined is not None and self._transfer.joined[0] == source.group
                else frozenset()
            )
            newly: set[str] = set()

            async def load(engine: EngineHandle) -> None:
                if engine.url not in joined:
                    try:
                        await engine.client.init_transfer(
                            source.group, offsets[engine.url], self._load_timeout_s
                        )
                    except EngineError as exc:
                        raise StepError(WeightAction.INIT_TRANSFER, exc) from exc
                    newly.add(engine.url)
                await engine.client.receive_weights(source.group, source.tensors, self._load_timeout_s)

            try:
                await self._steps.load_and_label(
                    update, Loader(WeightAction.RECEIVE_WEIGHTS, load, staged=False), targets, paused, result
                )
            finally:
                self._transfer.joined = (source.group, frozenset(joined | newly))
                resumed = await self._resume(result)
                result.paused_s = loop.time() - started
            if any(e.updated for e in result.engines):
                self._used.append(version)
                await self._fleet.advance_order(version)
        except BaseException as exc:
            log.error(
                "weight_update_failed",
                weight_version=version,
                source="distributed",
                error=str(exc) or repr(exc),
            )
            raise
        self._report(result, resumed, "Fix the engines that missed it, plan again and repeat the update")
        return result

    async def _resume(self, result: WeightUpdateResult) -> FleetResult | None:
        """Out of rotation what did not update, back in what did; then resume every engine.

        When no engine updated, the fleet stays on its previous version: only the engines whose
        load failed (their weights may be gone) leave the rotation; the others keep serving.
        """
        any_updated = any(o.updated for o in result.engines)
        rotation: dict[str, str] = {}
        for outcome in result.engines:
            engine = self._pool.get(outcome.url)
            if engine is None:
                continue
            if outcome.updated:
                rotation[engine.url] = ""
            elif any_updated or outcome.load_failed:
                rotation[engine.url] = f"weight update to {result.weight_version!r} failed: {outcome.error}"
            if engine.url in rotation:
                self._pool.set_weights_problem(engine, rotation[engine.url])
        updated = [o.url for o in result.engines if o.updated]
        try:  # the other workers of this replica route the same way and know the new labels
            await self._control.weights_updated(result.weight_version, updated, rotation)
        except Exception as exc:
            log.error("weight_update_sync_failed", weight_version=result.weight_version, error=str(exc))
        if self._memory.asleep:  # colocated: generation resumes when ResumeMemory brought everything back
            log.info("weight_update_resume_deferred", asleep=sorted(self._memory.asleep))
            return FleetResult()
        try:
            return await self._control.resume(None)
        except Exception as exc:  # reported with the update's outcome; never hides the load's error
            log.error("weight_update_resume_failed", weight_version=result.weight_version, error=str(exc))
            return None

    def _report(
        self,
        result: WeightUpdateResult,
        resumed: FleetResult | None,
        hint: str = "Repeat the same call to load on the engines that missed it",
    ) -> None:
        failed = result.failed
        log.info(
            "weight_update_done" if not failed else "weight_update_failed",
            weight_version=result.weight_version,
            previous_versions=result.previous_versions,
            updated=[e.url for e in result.engines if e.updated],
            not_updated={e.url: e.error for e in failed},
            out_of_rotation=sorted(e.url for e in self._pool.engines if e.weights_problem),
            resumed=len(resumed.ok) if resumed is not None else 0,
            resume_errors=len(resumed.errors) if resumed is not None else -1,
            paused_s=round(result.paused_s, 3),
            load_s=round(result.load_s, 3),
            retry=result.retry,
        )
        if failed:
            causes = "; ".join(f"{e.url}: {e.error}" for e in failed)
            updated = len(result.engines) - len(failed)
            if updated:
                state = f"{updated} engine(s) serve {result.weight_version!r}, the others are out of rotation"
            else:
                previous = ", ".join(repr(v) for v in result.previous_versions) or "their previous weights"
                state = f"no engine serves it; the engines in rotation still serve {previous}"
            raise Unavailable(
                f"weight update to {result.weight_version!r} failed on {len(failed)} engine(s) ({causes}); "
                f"{state}. {hint}"
            )
