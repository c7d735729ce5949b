"""The state of one running step, and what every part of the step does to it: stop a group or
all of them (an abort, never a cancel: the tokens come back), close the step's clients, count.

The step is one object (`loop.Step`) built from three parts that share this state: the loop
(`loop.py`), one group's work (`group.py`) and what happens to the groups the step does not
finish (`drain.py`). They are mixins over this base so that each file holds one job while the
step stays one object with one set of fields.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from rollout_grpc.server.envs.api import Environment
from rollout_grpc.server.rewards.api import (
    GroupFilter,
    RewardModel,
)
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.step.buffer import DrainLease, StepBuffers
from rollout_grpc.server.rollout.step.events import Progress, SampleEnded
from rollout_grpc.server.rollout.step.policy import Counters, OverSampling, StartPolicy
from rollout_grpc.server.rollout.step.spec import (
    Leftovers,
    Outcome,
    PromptGroup,
    StepSample,
    StepSpec,
)
from rollout_grpc.server.rollout.step.versions import FleetVersions

log = structlog.get_logger("rollout_grpc.server.rollout.step.runner")


def keeps_buffer(spec: StepSpec) -> bool:
    """Whether a step reads or writes its caller's buffer when its caller stays."""
    return spec.continue_buffered or spec.leftovers is Leftovers.BUFFER


class StepHost(Protocol):
    """What a running step needs of the runner that started it (`runner.StepRunner`)."""

    @property
    def rollout(self) -> Rollout: ...

    @property
    def buffers(self) -> StepBuffers: ...

    @property
    def versions(self) -> FleetVersions: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...

    async def abort_ids(self, request_ids: list[str]) -> object: ...


@dataclass(slots=True, eq=False)
class GroupRun:
    """A group in flight: its samples' tasks and request ids, and whether the step stopped it."""

    group: PromptGroup
    items: list[StepSample]
    request_ids: list[str]
    regenerated: bool = False
    stopping: bool = False
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[GroupDone] | None = None


@dataclass(slots=True)
class GroupDone:
    """What a group coordinator hands the loop."""

    run: GroupRun
    outcome: Outcome | None  # None: leftover (stopped, or aborted from outside)
    reason: str = ""
    fatal: bool = False  # the step must stop (FAIL_GROUP on a reward failure)
    stop_reason: str = ""  # why, when it is not a reward's failure (a custom filter failed)


class StepState:
    """The state of one running step."""

    def __init__(
        self,
        runner: StepHost,
        spec: StepSpec,
        owner: str,
        model: RewardModel | None,
        share: int = 0,
        buffer: str | None = None,
        lease: DrainLease | None = None,
        buffered: list[PromptGroup] | None = None,
        *,
        env: Environment | None = None,
    ) -> None:
        self.runner = runner
        #: The environment server of an episode step (None: one-turn samples).
        self.env = env
        self.rollout = runner.rollout
        self.spec = spec
        self.owner = owner
        #: The store key of the caller's buffer (None: an anonymous caller that named none).
        self.buffer = buffer
        #: Held until every group this step will buffer is in the store (released by events() or
        #: by the drain of an abandoned step).
        self.lease = lease
        #: The step reads or writes the caller's buffer (BUFFER leftovers or continue_buffered): a
        #: RETURN step that continues nothing makes no buffer call unless its caller leaves.
        self.keeps_buffer = keeps_buffer(spec)
        self.model = model
        buffered = buffered or []
        self.from_buffer = {id(g) for g in buffered}
        self.queue: deque[tuple[PromptGroup, bool]] = deque((g, False) for g in [*buffered, *spec.groups])
        self.target = spec.target_groups or len(self.queue)
        # slime's rule with no explicit bound stays within the caller's share (a bound the caller
        # sets is checked against it up front).
        bound = spec.max_groups_in_flight
        if not bound and spec.over_sampling is OverSampling.SLIME_BATCHES:
            bound = share
        self.policy = StartPolicy.of(spec.over_sampling, self.target, spec.over_sampling_batch_size, bound)
        self.counters = Counters()
        #: Why staleness admission stopped starting groups ("" while it allows them).
        self.admission_refusal = ""
        self.active: dict[int, GroupRun] = {}
        #: Groups accounted as ended whose events are not sent yet (the next batch starts first):
        #: still held only by this process (`_hold`).
        self.delivering: set[int] = set()
        self.events_q: asyncio.Queue[SampleEnded | GroupDone] = asyncio.Queue()
        self.progress = Progress(pending=len(self.queue))
        #: A step streams no deltas: only final samples, so engines batch tokens into fewer events.
        self.options = dataclasses.replace(spec.options, final_only=True)
        self.stop_reason = ""
        self.saw_abort_all = False
        self.max_lag = 0
        self.finished = False
        #: A plugin or remote filter applied after the built-in one (hooks.py).
        self.custom_filter: GroupFilter | None = None
        self.started = False

    def _on_owner_abort(self) -> None:
        if not self.stop_reason:
            self._stop_all("the caller's generations were aborted (Abort mine)")

    def _stop_all(self, reason: str) -> None:
        """Stop starting groups and abort every group in flight (their tokens come back)."""
        self.stop_reason = reason
        self._stop(*self.active.values())

    def _stop(self, *runs: GroupRun) -> None:
        """Stop `runs` (those not stopping yet) with one abort of all their samples.

        Why one: at the target every group still in flight stops at once, and an abort per group
        was one fan-out to every engine per group (two engines, 30 groups at G = 32: 60 HTTP
        calls where slime's loop sends one Abort), all while the step waits for those groups'
        tokens to come back."""
        ids: list[str] = []
        for run in runs:
            if run.stopping:
                continue
            run.stopping = True
            run.stopped.set()
            ids += run.request_ids
        if ids:
            self.runner.spawn(self._abort(ids))

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            await self.runner.abort_ids(request_ids)
        except Exception:  # the drain bound of Rollout.generate still ends the samples
            log.exception("step_abort_failed", step_id=self.spec.step_id)

    async def _close_hooks(self) -> None:
        """Close the reward model and the custom filter and the environment (their HTTP sessions)."""
        if self.model is not None:
            await self.model.close()
        if self.custom_filter is not None:
            await self.custom_filter.close()
        if self.env is not None:
            await self.env.close()

    def _progress(self) -> Progress:
        self.progress.in_flight = len(self.active)
        self.progress.pending = len(self.queue)
        return dataclasses.replace(self.progress, dropped=dict(self.progress.dropped))

    def _lags(self, items: list[StepSample]) -> list[int]:
        """Per sample, the weight-version lag of its first generated token (0 without tokens)."""
        versions = self.runner.versions
        return [
            versions.lag(i.sample.weight_versions[0].version) if i.sample.weight_versions else 0
            for i in items
        ]
