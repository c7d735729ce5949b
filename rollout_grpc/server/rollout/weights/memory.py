"""Colocated training's memory: ReleaseMemory frees the engines' memory (paused with ABORT first),
ResumeMemory takes it back and resumes generation once every region is back.

Kept apart from the weight update because it is its own operation with its own state (the regions
freed and not yet taken back); it shares the update's fleet lease (so the two never interleave)
and the update reads `asleep` to defer its resume until the memory is back.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.engines.api import MEMORY_TAGS, MemoryRelease, WeightAction
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.rollout.control import Control, FleetResult
from rollout_grpc.server.rollout.weights.engine_steps import EngineSteps
from rollout_grpc.server.rollout.weights.fleet import FleetLease
from rollout_grpc.server.rollout.weights.values import memory_tags

log = structlog.get_logger("rollout_grpc.server.rollout.weights")


class ColocatedMemory:
    """ReleaseMemory / ResumeMemory over the pool, the fleet control and the fleet lease."""

    def __init__(
        self,
        pool: EnginePool,
        control: Control,
        steps: EngineSteps,
        fleet: FleetLease,
        refuse_if_busy: Callable[[str], None],
    ) -> None:
        self._pool = pool
        self._control = control
        self._steps = steps
        self._fleet = fleet
        #: FAILED_PRECONDITION while a weight update runs on this replica.
        self._refuse_if_busy = refuse_if_busy
        #: Memory regions the engines freed (ReleaseMemory) and have not taken back yet.
        self.asleep: set[str] = set()

    async def release_memory(self, release: MemoryRelease) -> FleetResult:
        """Pause every engine (ABORT) and free its memory; fails when no engine freed any."""
        if release.level not in (0, 1, 2):
            raise InvalidArgument("level", f"must be 0, 1 or 2 (vLLM's sleep levels); got {release.level}")
        tags = memory_tags(release.tags)
        self._refuse_if_busy("release memory")
        async with self._fleet.lease("release memory"):
            return await self._release_memory(release, tags)

    async def _release_memory(self, release: MemoryRelease, tags: tuple[str, ...]) -> FleetResult:
        paused = await self._control.pause("abort")
        engines = [e for e in self._pool.engines if e.url in paused.ok]
        result = await self._steps.each(
            engines, WeightAction.RELEASE_MEMORY, lambda e: e.client.release_memory(release)
        )
        result.extend(paused)
        self.asleep.update(tags or MEMORY_TAGS)
        log.info(
            "memory_released",
            level=release.level,
            tags=list(tags),
            released=len(result.ok),
            errors=len(result.errors),
        )
        result.raise_if_none_ok("release memory")
        return result

    async def resume_memory(self, tags: tuple[str, ...]) -> tuple[FleetResult, bool]:
        """Take the regions `tags` (all when empty) back on every engine; resume generation once
        every region is back. (result, whether the engines were resumed)."""
        tags = memory_tags(tags)
        self._refuse_if_busy("resume memory")
        async with self._fleet.lease("resume memory"):
            return await self._resume_memory(tags)

    async def _resume_memory(self, tags: tuple[str, ...]) -> tuple[FleetResult, bool]:
        result = await self._steps.each(
            self._pool.engines, WeightAction.RESUME_MEMORY, lambda e: e.client.resume_memory(tags)
        )
        self.asleep.difference_update(tags or MEMORY_TAGS)
        generating = not self.asleep
        if generating:
            resumed = await self._control.resume(None)
            result.extend(resumed, "resume: ")
        log.info(
            "memory_resumed",
            tags=list(tags),
            resumed=len(result.ok),
            errors=len(result.errors),
            generating=generating,
        )
        result.raise_if_none_ok("take memory back")
        return result, generating
