"""One running step's loop: keep up to the allowed groups in flight (the over-sampling policy and
staleness admission), account each group that ends (accepted, dropped, stale, leftover), stop on
the target, an abort or shutdown, and end with the summary (or, when the caller left, the drain).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog

from rollout_grpc.server.domain import sample_ops
from rollout_grpc.server.rollout.step.drain import StepDrain
from rollout_grpc.server.rollout.step.events import GroupEnded, SampleEnded, StepEvent, Summary
from rollout_grpc.server.rollout.step.group import GroupWork
from rollout_grpc.server.rollout.step.spec import (
    OnStale,
    Outcome,
    PromptGroup,
    StepSample,
)
from rollout_grpc.server.rollout.step.state import GroupDone, GroupRun
from rollout_grpc.server.state.api import StoreUnavailable

log = structlog.get_logger("rollout_grpc.server.rollout.step.runner")


class Step(GroupWork, StepDrain):
    """One running step: the loop over its groups (`GroupWork`) and its leftovers (`StepDrain`)."""

    async def events(self) -> AsyncIterator[StepEvent]:
        self.started = True  # from here events() releases the lease (or its drain does)
        unwatch = self.rollout.watch_owner_aborts(self.owner, self._on_owner_abort)
        returned: set[int] = set()  # group indexes this step hands the caller (not buffered)
        try:
            await self._fill()
            yield self._progress()
            while self.active:
                for out in await self._account(await self._ended()):
                    _note_returned(out, returned)
                    yield out
                if self.delivering:
                    self.delivering.clear()
                    await self._hold()  # the ended groups were delivered (or buffered)
                yield self._progress()
            for handed_back in await self._put_back():
                _note_returned(handed_back, returned)
                yield handed_back
            summary = await self._summary(returned)
            self.finished = True  # before the yield: a caller leaving now has nothing left to lose
            if self.lease is not None:
                # Before the summary leaves: a caller holding it finds no lease of this step, also
                # when this process dies right after (its lease would hold the caller's next
                # continue step until it expired). Cancelled meanwhile: `_release` ends it.
                await self.lease.end()
                self.lease = None
            yield summary
        finally:
            unwatch()
            await self._release()

    async def _ended(self) -> list[GroupDone | SampleEnded]:
        """What ended since the last look: the next event, and the ones already queued behind it
        up to and including the next group.

        Why not one at a time: a wave of samples ends together, so hundreds of sample events are
        queued, and every message the step sends waits for the caller's stream. One progress
        message per sample held a group that ended behind all of them, and the next
        over-sampling batch started late (bench/step_trace.py: a dropped group was judged, then
        accounted 0.3-0.6 s and 20-30 messages later, while slime's loop over Generate refilled
        within 0.05 s). Now the samples ahead of a group are counted without a message each and
        the group is accounted (the next batch started) before anything is sent. One group per
        look: a group's events are still sent before the next group is accounted.
        """
        events: list[GroupDone | SampleEnded] = [await self.events_q.get()]
        while not isinstance(events[-1], GroupDone) and not self.events_q.empty():
            events.append(self.events_q.get_nowait())
        return events

    async def _account(self, ended: list[GroupDone | SampleEnded]) -> list[StepEvent]:
        """Account what ended, in order, and start the groups the policy allows once a group
        ended; the events to send (each sample's with `stream_samples`, then the group's)."""
        out: list[StepEvent] = []
        for event in ended:
            if isinstance(event, SampleEnded):
                self.progress.generated += 1
                if self.spec.stream_samples:
                    out.append(event)
                continue
            events = await self._group_done(event)
            # Until sent, a group is held only here (a buffered one is in the store already).
            self.delivering.update(
                e.group_index
                for e in events
                if isinstance(e, GroupEnded) and e.outcome is not Outcome.BUFFERED
            )
            out += events
            if not self.stop_reason and self._aborted_from_outside():
                self._stop_all("the generations were aborted (Abort all)")
            if not self.stop_reason and self.rollout.closed:
                self._stop_all("the replica is shutting down; continue the groups on another one")
            if not self.stop_reason:
                await self._fill()  # names the ended group held until it is sent (`delivering`)
        return out

    async def _release(self) -> None:
        """The step's end (the stream is released after this): an abandoned step drains its
        groups to the buffer, still holding its lease; a finished one gives the lease back."""
        if not self.finished:
            await self._lease_abandoned()  # in the store before the stream is released
            self._abandon()
            return
        if self.lease is not None:
            # In the background: a cancelled call must not leave the lease to expire.
            self.runner.spawn(self.lease.end())
        await self._close_hooks()

    async def _fill(self) -> None:
        """Start the prompt groups the over-sampling policy allows now (policy.py), unless
        staleness admission refuses new work. The groups this process holds are named in the store
        first (`_hold`: the ended ones gone, the starting ones in)."""
        admission = self.spec.admission
        if admission is not None:
            self.admission_refusal = admission.refusal(self.runner.versions)
            if self.admission_refusal:
                await self._hold()
                return
        counters = self.counters
        counters.accepted = self.progress.accepted
        counters.in_flight = len(self.active)
        starts = [self.queue.popleft() for _ in range(self.policy.to_start(counters, len(self.queue)))]
        counters.submitted += len(starts)
        await self._hold([g.group_index for g, _ in starts])
        started = 0
        try:
            for group, regenerated in starts:
                if self.stop_reason:
                    break  # stopped meanwhile (an Abort of the caller's): the rest is not started
                self._start(group, regenerated)
                started += 1
                # Why yield after each group: the batch's groups were all prepared before any of
                # their samples was sent (the event loop runs every group's coordinator, then
                # every sample's first step, then every engine request), so the first request of
                # a 32-group batch left 0.1-0.2 s after the batch started (bench/step_trace.py);
                # now each group's requests go out while the next groups are prepared. One
                # scheduling round per group, no waiting on anything.
                await asyncio.sleep(0)
        finally:
            rest = starts[started:]  # not started (stopped or cancelled meanwhile): back in line
            self.queue.extendleft(reversed(rest))
            counters.submitted -= len(rest)

    def _start(self, group: PromptGroup, regenerated: bool) -> None:
        spec = self.spec
        if group.partial and not regenerated:
            items = group.partial
            for item in items:
                item.sample.group_index = group.group_index
        else:
            items = []
            for i in range(spec.n_samples_per_prompt):
                sample = sample_ops.fork(group.prompt)
                sample.group_index = group.group_index
                sample.session_id = sample.session_id or f"{spec.step_id}/g{group.group_index}"
                items.append(
                    StepSample(
                        sample, group.prompt_index + i, origin=group.origin, start_step_id=spec.step_id
                    )
                )
        suffix = "/r" if regenerated else ""
        ids = [f"{spec.step_id}/g{group.group_index}/s{i}{suffix}" for i in range(len(items))]
        run = GroupRun(group, items, ids, regenerated=regenerated)
        run.task = asyncio.create_task(self._coordinate(run))
        self.active[group.group_index] = run

    async def _group_done(self, done: GroupDone) -> list[StepEvent]:
        """Account a finished group; its events."""
        run = done.run
        self.active.pop(run.group.group_index, None)
        if done.outcome is None:
            if not self.stop_reason:
                # Aborted from outside (Abort of its group or session): the step goes on, and the
                # over-sampling rule counts it as a group that will not be accepted.
                self.counters.dropped += 1
            return [await self._leftover(run, done.reason)]
        lags = self._lags(run.items)
        outcome, reason = done.outcome, done.reason
        if outcome is Outcome.ACCEPTED and self.spec.max_staleness is not None:
            worst = max(lags, default=0)
            if worst > self.spec.max_staleness:
                outcome = Outcome.STALE
                reason = (
                    f"a sample is {worst} weight versions behind (max_staleness {self.spec.max_staleness})"
                )
                if self.spec.on_stale is OnStale.REGENERATE and not run.regenerated:
                    reason += "; regenerating the group once"
                    self.queue.appendleft((run.group, True))
        if outcome is Outcome.ACCEPTED and self.progress.accepted >= self.target:
            return [await self._leftover(run, "the target was reached")]
        if outcome is Outcome.ACCEPTED:
            self.progress.accepted += 1
            self.max_lag = max(self.max_lag, *lags, 0)
            if self.progress.accepted >= self.target:
                self._stop_all("the target was reached")
        else:
            kind = {
                Outcome.FILTERED: "filter",
                Outcome.STALE: "stale",
                Outcome.FAILED: "reward_failed" if done.reason.startswith("reward") else "failed",
            }.get(outcome, outcome.value)
            self.progress.dropped[kind] = self.progress.dropped.get(kind, 0) + 1
            self.counters.dropped += 1
        if done.fatal and not self.stop_reason:
            self._stop_all(done.stop_reason or f"a reward failed (on_failure FAIL_GROUP): {done.reason}")
        return [GroupEnded(run.group.group_index, outcome, reason, run.items, lags)]

    def _aborted_from_outside(self) -> bool:
        """An Abort(all) ended samples of this step (Abort mine stops the step at once)."""
        return self.saw_abort_all

    async def _summary(self, returned: set[int]) -> Summary:
        """The step's summary. `lost` leaves out the groups this step returned itself: a lease
        that expired while this process lived (it lost the store) had them reported lost, but
        the caller has them (drain.py)."""
        # Fresh groups never started are listed (buffered ones went back by `_put_back`).
        buffers, buffer = self.runner.buffers, self.buffer
        unstarted = [g.group_index for g, _ in self.queue if id(g) not in self.from_buffer]
        reached = self.progress.accepted >= self.target
        if self.stop_reason:
            reason = self.stop_reason
        elif reached:
            reason = "the target was reached"
        else:
            reason = self.admission_refusal or "no prompt groups left"
        buffered, lost = 0, []
        if buffer is not None and self.keeps_buffer:
            try:
                buffered, lost = await buffers.count(buffer), await buffers.take_lost(buffer)
                lost = [i for i in lost if i not in returned]
            except StoreUnavailable as exc:  # every group was reported; only the counts are unknown
                reason += f"; {exc}: buffered and lost_group_indexes are unknown"
        return Summary(
            accepted=self.progress.accepted,
            target_reached=reached,
            reason=reason,
            buffered=buffered,
            unstarted=unstarted,
            progress=self._progress(),
            max_version_lag=self.max_lag,
            lost=lost,
        )


def _note_returned(event: StepEvent, returned: set[int]) -> None:
    """Count a group this step hands the caller (any outcome but BUFFERED) in `returned`."""
    if isinstance(event, GroupEnded) and event.outcome is not Outcome.BUFFERED:
        returned.add(event.group_index)
