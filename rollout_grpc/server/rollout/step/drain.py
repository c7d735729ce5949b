"""The groups a step does not finish: a stopped group returned or buffered, groups taken from the
buffer and never started put back, and an abandoned step (the caller left) drained to the
caller's buffer from the background, so that no token is lost.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

import structlog

from rollout_grpc.server.rollout.step.events import GroupEnded
from rollout_grpc.server.rollout.step.spec import (
    Leftovers,
    Outcome,
    PromptGroup,
)
from rollout_grpc.server.rollout.step.state import GroupRun, StepState
from rollout_grpc.server.state.api import StoreUnavailable

log = structlog.get_logger("rollout_grpc.server.rollout.step.runner")


#: Why a group is handed back instead of buffered once the step's drain lease expired.
LEASE_EXPIRED = (
    "this step's drain lease expired (the replica did not reach the state store for longer than "
    "--step-drain-lease-ttl-s) and the groups it held are reported lost to your next step; "
    "returned instead of buffered"
)


class StepDrain(StepState):
    """The part of a step that keeps the groups it does not finish.

    Once a renewal found the step's drain lease gone (`DrainLease.expired`), the store has reported
    (or will report) the groups the lease held as lost: the step buffers nothing more, so that no
    group is both in the buffer and in the lost list (a continue step would then continue a group
    and report it lost at once). Its leftovers come back to the caller ABORTED with their tokens
    (`LEASE_EXPIRED`), and an abandoned step's groups, with nobody to hand them to, are noted lost.
    """

    def _lease_expired(self) -> bool:
        return self.lease is not None and self.lease.expired

    async def _leftover(self, run: GroupRun, reason: str) -> GroupEnded:
        """A group the step stopped (or that was aborted from outside): returned or buffered."""
        group = run.group
        if self._lease_expired():
            reason += f"; {LEASE_EXPIRED}"
        elif self.spec.leftovers is Leftovers.BUFFER and self.buffer is not None:
            kept = PromptGroup(
                group.group_index, group.prompt, group.origin, group.prompt_index, group.label, run.items
            )
            try:
                if not await self.runner.buffers.put(self.buffer, [kept]):
                    # The samples stay on the event for accounting; the wire omits them (they are here).
                    return GroupEnded(
                        group.group_index, Outcome.BUFFERED, reason, run.items, self._lags(run.items)
                    )
                reason += f"; {await self.runner.buffers.full_reason(self.buffer)}, returned instead"
            except StoreUnavailable as exc:  # the caller keeps every token: the group comes back
                reason += f"; {exc}, returned instead"
        return GroupEnded(group.group_index, Outcome.ABORTED, reason, run.items, self._lags(run.items))

    async def _hold(self, starting: Sequence[int] = ()) -> None:
        """Name in the store the groups only this process holds (in flight, `starting`, ended but
        not yet sent, taken from the buffer and not started), so that they are reported lost if it
        dies (buffer.py)."""
        if self.lease is None:
            return
        from_buffer = (g.group_index for g, _ in self.queue if id(g) in self.from_buffer)
        await self.lease.hold({*self.active, *starting, *self.delivering, *from_buffer})

    async def _lease_abandoned(self) -> None:
        """The caller left: the groups in flight go to its buffer, under a lease (taken now by a
        step that returns its leftovers) that names them until they are there."""
        if self.lease is None and self.buffer is not None:
            try:
                self.lease = await self.runner.buffers.lease(self.buffer)
            except StoreUnavailable as exc:  # the drain then fails to put them too, and says so
                log.warning("step_abandoned_unleased", step_id=self.spec.step_id, why=str(exc))
        await self._hold()

    def _abandon(self) -> None:
        """The caller left mid-step: abort what is in flight and buffer it (and what the step took
        from the buffer but never started) from the background: nothing is lost."""
        runs = list(self.active.values())
        self._stop(*runs)
        unstarted = [g for g, _ in self.queue if id(g) in self.from_buffer]
        log.warning("step_abandoned", step_id=self.spec.step_id, in_flight=len(runs), owner=self.owner)
        self.runner.spawn(self._drain_to_buffer(runs, unstarted))

    async def _drain_to_buffer(self, runs: list[GroupRun], unstarted: list[PromptGroup]) -> None:
        try:
            await self._drain_groups(runs, unstarted)
        finally:
            if self.lease is not None:
                await self.lease.end()
            await self._close_hooks()

    async def _drain_groups(self, runs: list[GroupRun], unstarted: list[PromptGroup]) -> None:
        groups = list(unstarted)
        for run in runs:
            assert run.task is not None
            await asyncio.wait([run.task])
            group = run.group
            groups.append(
                PromptGroup(
                    group.group_index, group.prompt, group.origin, group.prompt_index, group.label, run.items
                )
            )
        if self.buffer is None:
            # An anonymous caller that named no buffer has none: these groups cannot be kept for it.
            log.error(
                "step_abandoned_unbuffered",
                step_id=self.spec.step_id,
                lost_groups=[g.group_index for g in groups],
                why="an anonymous caller named no buffer_name",
            )
            return
        if self._lease_expired():  # reported lost, never buffered too (class docstring)
            lost = [g.group_index for g in groups]
            await self.runner.buffers.note_lost(self.buffer, lost)
            log.error(
                "step_abandoned_unbuffered", step_id=self.spec.step_id, lost_groups=lost, why=LEASE_EXPIRED
            )
            return
        try:
            rejected = await self.runner.buffers.put(self.buffer, groups)
        except StoreUnavailable as exc:  # nobody to hand them to: said loudly, with their indexes
            log.error(
                "step_abandoned_unbuffered",
                step_id=self.spec.step_id,
                lost_groups=[g.group_index for g in groups],
                why=str(exc),
            )
            return
        if rejected:
            # The caller is gone: its next step's summary names these groups (lost_group_indexes).
            lost = [g.group_index for g in rejected]
            await self.runner.buffers.note_lost(self.buffer, lost)
            log.error(
                "step_buffer_full",
                owner=self.owner,
                lost_groups=lost,
                why=await self.runner.buffers.full_reason(self.buffer),
            )

    async def _put_back(self) -> list[GroupEnded]:
        """Groups taken from the buffer and never started go back to it. They came out of this
        caller's buffer, so they fit back unless another step of the caller filled it meanwhile:
        those are reported like an abandoned step's overflow. When the store does not answer they
        are handed to the caller instead (ABORTED with their tokens, the reason naming the store)."""
        back = [g for g, _ in self.queue if id(g) in self.from_buffer]
        buffers, buffer = self.runner.buffers, self.buffer
        if not back or buffer is None:
            return []
        why = LEASE_EXPIRED
        try:
            if not self._lease_expired():
                rejected = await buffers.put(buffer, back)
                await buffers.note_lost(buffer, [g.group_index for g in rejected])
                return []
        except StoreUnavailable as exc:
            why = f"{exc}; returned instead"
        self.queue = deque((g, r) for g, r in self.queue if id(g) not in self.from_buffer)
        return [
            GroupEnded(g.group_index, Outcome.ABORTED, why, g.partial, self._lags(g.partial)) for g in back
        ]
