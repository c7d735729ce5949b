"""One group of a step: its samples generated concurrently (never cancelled: an abort ends them
with every token), scored per sample as each ends or as a whole group, then judged (failures,
rewards, the built-in filter, the custom filter) into the outcome the loop accounts.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import structlog

from rollout_grpc.server.domain import sample_ops
from rollout_grpc.server.domain.errors import RolloutError
from rollout_grpc.server.domain.model import Finish, Sample, SamplingParams, Status
from rollout_grpc.server.rewards.api import (
    FilterFailed,
    RewardFailed,
    RewardOutcome,
    RewardRequest,
)
from rollout_grpc.server.rollout.step import episodes, filters, hooks
from rollout_grpc.server.rollout.step.events import SampleEnded
from rollout_grpc.server.rollout.step.spec import (
    OnRewardFailure,
    Outcome,
    RewardScope,
    StepSample,
)
from rollout_grpc.server.rollout.step.state import GroupDone, GroupRun, StepState

log = structlog.get_logger("rollout_grpc.server.rollout.step.runner")


class GroupWork(StepState):
    """The part of a step that runs one group (a coordinator task per group)."""

    async def _coordinate(self, run: GroupRun) -> GroupDone:
        """Generate the group's samples, score them, decide the outcome; never raises."""
        try:
            done = await self._group(run)
        except Exception as exc:
            log.exception("step_group_failed", step_id=self.spec.step_id, group_index=run.group.group_index)
            done = GroupDone(run, Outcome.FAILED, f"internal error: {exc!r}"[:300])
        self.events_q.put_nowait(done)
        return done

    async def _group(self, run: GroupRun) -> GroupDone:
        spec = self.spec
        per_sample = self.model is not None and spec.reward_scope is RewardScope.SAMPLE
        generations: dict[asyncio.Task[Any], StepSample] = {
            asyncio.create_task(self._generate(run, item, i, rid)): item
            for i, (item, rid) in enumerate(zip(run.items, run.request_ids, strict=True))
        }
        scores: set[asyncio.Task[None]] = set()
        waiting: set[asyncio.Task[Any]] = set(generations)
        stop = asyncio.create_task(run.stopped.wait())
        try:
            while waiting:
                wake = waiting if stop.done() else waiting | {stop}
                done, waiting = await asyncio.wait(wake, return_when=asyncio.FIRST_COMPLETED)
                waiting.discard(stop)
                for task in done:
                    item = generations.get(task)
                    if item is None:
                        continue
                    self.events_q.put_nowait(SampleEnded(run.group.group_index, item))
                    if per_sample and not run.stopping and item.sample.status in sample_ops.FINISHED:
                        score = asyncio.create_task(self._score(item, run.group.label))
                        scores.add(score)
                        waiting.add(score)
                if run.stopping:
                    for score in scores:
                        score.cancel()
                    waiting -= scores
                    if not any(t in generations for t in waiting):
                        break
        finally:
            stop.cancel()
        # Every generation has ended (it is never cancelled): the samples hold every token.
        await asyncio.wait(list(generations))
        if run.stopping:
            return GroupDone(run, None, self.stop_reason or "stopped by the step")
        return await self._judge(run)

    async def _judge(self, run: GroupRun) -> GroupDone:
        """The outcome of a group whose samples all ended: failures, rewards, filter."""
        spec = self.spec
        items = run.items
        for item in items:
            if item.sample.status is Status.ABORTED:
                why = item.sample.failure_reason or "by an Abort (group, session or caller)"
                return GroupDone(run, None, f"sample {item.index} was aborted: {why}")
        for item in items:
            if item.sample.status is Status.FAILED:
                return GroupDone(
                    run, Outcome.FAILED, f"sample {item.index} failed: {item.sample.failure_reason}"
                )
        if self.model is None and self.env is None:
            return await self._custom_verdict(run)
        if (
            self.model is not None
            and spec.reward_scope is RewardScope.GROUP
            and not await self._score_group(run)
        ):
            return GroupDone(run, None, self.stop_reason or "stopped by the step")
        failed = [i for i in items if i.reward_failure]
        if failed and spec.on_reward_failure is not OnRewardFailure.KEEP_UNSCORED:
            reason = f"reward of sample {failed[0].index} failed: {failed[0].reward_failure}"
            return GroupDone(
                run, Outcome.FAILED, reason, fatal=spec.on_reward_failure is OnRewardFailure.FAIL_GROUP
            )
        rewards = [i.reward for i in items if i.reward is not None]
        drop = filters.drop_reason(spec.filter, rewards, spec.epsilon)
        if drop is not None:
            return GroupDone(run, Outcome.FILTERED, drop)
        return await self._custom_verdict(run)

    async def _custom_verdict(self, run: GroupRun) -> GroupDone:
        """The custom filter's verdict (accepted without one); one that cannot decide fails the
        group and stops the step: a broken filter is not hidden behind over-sampling."""
        if self.custom_filter is None:
            return GroupDone(run, Outcome.ACCEPTED)
        try:
            drop = await self.custom_filter.verdict(hooks.view(run.group, run.items))
        except FilterFailed as exc:
            reason = f"the filter failed: {exc}"
            return GroupDone(run, Outcome.FAILED, reason, fatal=True, stop_reason=reason)
        if drop is not None:
            return GroupDone(run, Outcome.FILTERED, drop)
        return GroupDone(run, Outcome.ACCEPTED)

    async def _score_group(self, run: GroupRun) -> bool:
        """Score the whole group in one call; False when the step stopped meanwhile."""
        assert self.model is not None
        requests = [self._request(i, run.group.label) for i in run.items]
        scoring = asyncio.ensure_future(self.model.score_group(requests))
        stop = asyncio.ensure_future(run.stopped.wait())
        await asyncio.wait([scoring, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not scoring.done():
            scoring.cancel()
            return False
        for item, outcome in zip(run.items, scoring.result(), strict=True):
            self._apply(item, outcome)
        return True

    async def _generate(self, run: GroupRun, item: StepSample, i: int, request_id: str) -> None:
        """One sample through `Rollout.generate` (Generate's path); errors end it FAILED with its
        tokens. Never cancelled by the step: an abort ends it."""
        sample = item.sample
        if run.stopping:
            if sample.status not in sample_ops.FINISHED:
                sample_ops.finish(sample, Finish.ABORT, Status.ABORTED)
            return
        params = self._params(i, run.group.params)
        if self.env is not None and self.spec.episode is not None:
            ctx = episodes.EpisodeContext(
                self.rollout, self.env, self.spec.episode, params, self.options, request_id,
                episode_id=request_id, prompt=run.group.prompt.prompt or "", label=run.group.label,
                group_index=run.group.group_index, sample_index=item.index, stopped=run.stopped,
            )  # fmt: skip
            await episodes.play(ctx, item)
            if item.reward is not None or item.reward_failure:
                self.progress.scored += 1
            return
        before = sample.response_length
        try:
            async for event in self.rollout.generate(sample, params, self.options, request_id):
                if type(event) is Sample:
                    item.sample = event
                    # Checked before this task yields to the loop: the Abort(all) window is still
                    # open when its aborted generations hand back their samples.
                    if event.status is Status.ABORTED and self.rollout.aborting:
                        self.saw_abort_all = True
        except RolloutError as exc:
            sample_ops.finish(sample, Finish.ERROR, Status.FAILED, str(exc))
        item.new_tokens += item.sample.response_length - before

    def _params(self, i: int, own: SamplingParams | None = None) -> SamplingParams:
        """The sample's own copy of the parameters (the group's own, else the step's); seed = base
        seed + i (slime's sampling_seed)."""
        params = copy.deepcopy(own if own is not None else self.spec.params)
        if params.seed is not None:
            params.seed += i
        return params

    def _request(self, item: StepSample, label: str) -> RewardRequest:
        return RewardRequest(prompt=item.sample.prompt or "", response=item.sample.response, label=label)

    async def _score(self, item: StepSample, label: str) -> None:
        assert self.model is not None
        self._apply(item, await self.model.score(self._request(item, label)))

    def _apply(self, item: StepSample, outcome: RewardOutcome) -> None:
        self.progress.scored += 1
        if isinstance(outcome, RewardFailed):
            item.reward, item.reward_detail, item.reward_failure = None, None, outcome.reason
        else:
            item.reward, item.reward_failure = outcome.value, ""
            item.reward_detail = dict(outcome.detail) if outcome.detail is not None else None
