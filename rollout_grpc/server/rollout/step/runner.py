"""One rollout step: slime's `generate_rollout_async` loop as a use case over `Rollout.generate`.

The loop (docs/rollout-step.md has the diagram): keep up to `max_groups_in_flight` groups
generating; each group runs its `n` samples concurrently on one engine (a shared session key, so
the prompt's prefix cache is reused), scores each sample as it ends (or the whole group once all
ended), then applies the staleness bound and the dynamic filter. An accepted group is streamed at
once; a dropped one is reported with its reason and replaced by the next prompt group. At the
target, the groups still in flight are aborted (every token kept) and returned or buffered.

Why samples and group coordinators are separate tasks: a sample's generation must never be
cancelled (cancelling closes the engine stream, and tokens in flight would be lost); it is ended
by an abort, which hands back everything produced. Only reward work is ever cancelled. When the
caller goes away mid-step, every group still in flight is aborted the same way and lands in the
caller's buffer from a background task, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollout_grpc.server.domain import sample_ops
from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, RolloutError
from rollout_grpc.server.domain.identity import ANONYMOUS, current_caller
from rollout_grpc.server.domain.model import Finish, Sample, SamplingParams, Status
from rollout_grpc.server.envs.api import Environment, EnvUnavailable, EpisodeConfig
from rollout_grpc.server.rewards import allowlist as reward_urls
from rollout_grpc.server.rewards.api import (
    FilterFailed,
    GroupFilter,
    RewardConfig,
    RewardFailed,
    RewardKind,
    RewardModel,
    RewardOutcome,
    RewardRequest,
    RewardUnavailable,
)
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.step import episodes, filters, hooks
from rollout_grpc.server.rollout.step.buffer import DrainLease, StepBuffers, buffer_owner
from rollout_grpc.server.rollout.step.plugins import StepPlugins
from rollout_grpc.server.rollout.step.policy import Counters, OverSampling, StartPolicy
from rollout_grpc.server.rollout.step.spec import (
    MAX_GROUPS,
    UNKNOWN_CONTEXT_TOKENS,
    FilterKind,
    Leftovers,
    OnRewardFailure,
    OnStale,
    Outcome,
    PromptGroup,
    RewardScope,
    StepCounts,
    StepSample,
    StepSpec,
    check,
    check_counts,
)
from rollout_grpc.server.rollout.step.versions import FleetVersions
from rollout_grpc.server.state.api import StoreUnavailable

log = structlog.get_logger(__name__)

#: Builds the reward model of a step (the wiring passes `rewards.registry.build`).
RewardFactory = Callable[[RewardConfig], RewardModel | None]
#: Builds the environment client of an episode step (the wiring passes `envs.remote.RemoteEnvironment`).
EnvFactory = Callable[[EpisodeConfig], Environment]
#: Aborts request ids of the current caller (the wiring passes `Control.abort_ids`).
AbortIds = Callable[[list[str]], Awaitable[object]]


@dataclass(slots=True)
class SampleEnded:
    """A sample's generation ended (before its reward)."""

    group_index: int
    item: StepSample


@dataclass(slots=True)
class GroupEnded:
    """A group ended: accepted, dropped (with the reason), aborted or buffered."""

    group_index: int
    outcome: Outcome
    reason: str
    samples: list[StepSample]
    version_lag: list[int]


@dataclass(slots=True)
class Progress:
    """The step's counters."""

    generated: int = 0
    scored: int = 0
    accepted: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    pending: int = 0


@dataclass(slots=True)
class Summary:
    """The end of the step."""

    accepted: int
    target_reached: bool
    reason: str
    buffered: int
    unstarted: list[int]
    progress: Progress
    max_version_lag: int
    #: Groups of this caller's earlier, abandoned step that did not fit in its buffer.
    lost: list[int] = field(default_factory=list)


StepEvent = SampleEnded | GroupEnded | Progress | Summary


async def _no_probe() -> None:
    """A custom filter with nothing to probe (a plugin)."""


@dataclass(slots=True, eq=False)
class _GroupRun:
    """A group in flight: its samples' tasks and request ids, and whether the step stopped it."""

    group: PromptGroup
    items: list[StepSample]
    request_ids: list[str]
    regenerated: bool = False
    stopping: bool = False
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[_GroupDone] | None = None


@dataclass(slots=True)
class _GroupDone:
    """What a group coordinator hands the loop."""

    run: _GroupRun
    outcome: Outcome | None  # None: leftover (stopped, or aborted from outside)
    reason: str = ""
    fatal: bool = False  # the step must stop (FAIL_GROUP on a reward failure)
    stop_reason: str = ""  # why, when it is not a reward's failure (a custom filter failed)


class StepRunner:
    """Runs rollout steps on this replica (one per RolloutStep call)."""

    def __init__(
        self,
        rollout: Rollout,
        abort_ids: AbortIds,
        rewards: RewardFactory,
        *,
        buffers: StepBuffers | None = None,
        versions: FleetVersions | None = None,
        reward_urls: Sequence[str] = (),
        plugins: StepPlugins | None = None,
        remote_filters: hooks.RemoteFilterFactory | None = None,
        environments: EnvFactory | None = None,
        env_urls: Sequence[str] = (),
    ) -> None:
        #: Operator-installed reward and filter plugins (`--step-plugin`), and remote filters.
        self.plugins = plugins or StepPlugins()
        self._remote_filters = remote_filters
        self._rollout = rollout
        #: Episodes (docs/episodes.md): the environment client factory (None: refused) and the URL
        #: prefixes an environment may use (empty: any).
        self._environments = environments
        self._env_urls = tuple(env_urls)
        #: URL prefixes a REMOTE reward may use (empty: any).
        self._reward_urls = tuple(reward_urls)
        self._abort_ids = abort_ids
        self._rewards = rewards
        self.buffers = buffers or StepBuffers()
        #: The fleet's version order, read once per step (in the buffers' store by default).
        self.versions = versions or FleetVersions(self.buffers.store)
        self._background: set[asyncio.Task[Any]] = set()
        #: Longest a continue step waits for the drain leases of the caller's other steps (the
        #: call's deadline ends the wait sooner; a killed replica's lease expires sooner).
        self.drain_wait_s = 3600.0

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A task kept referenced until it ends (aborts, drains to the buffer)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drained(self) -> None:
        """Wait for the background work (tests; graceful stop)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def run(self, spec: StepSpec) -> AsyncIterator[StepEvent]:
        """Check the request, probe the step's clients, then run the loop (events as they happen)."""
        owner = current_caller().identity
        await self.versions.refresh()  # one read per step: every lag of the step against one newest
        buffer = await self._buffer_of(spec)
        await self._check(spec, buffer)
        clients = await self._clients(spec)
        lease = await self.buffers.lease(buffer) if buffer is not None else None
        try:
            buffered = await self.buffers.take(buffer) if spec.continue_buffered and buffer else []
        except BaseException:
            if lease is not None:
                await lease.end()
            await clients.close()
            raise
        step = _Step(
            self, spec, owner, clients.model, self._share_groups(spec, owner), buffer, lease, buffered,
            env=clients.env,
        )  # fmt: skip
        step.custom_filter = clients.custom
        try:
            async for event in step.events():
                yield event
        finally:
            if not step.started and lease is not None:
                self.spawn(lease.end())

    async def _buffer_of(self, spec: StepSpec) -> str | None:
        """The caller's buffer (None: an anonymous caller that named none), after the caller's
        earlier steps have drained into it."""
        buffer = buffer_owner(current_caller(), spec.buffer_name)
        if buffer is None and (spec.continue_buffered or spec.leftovers is Leftovers.BUFFER):
            raise InvalidArgument(
                "buffer_name",
                "an anonymous caller must name its buffer to buffer or continue groups (the client "
                "library names one per trainer process); two anonymous trainers never share one",
            )
        # The caller's earlier steps (on any worker or replica) hold drain leases until they have
        # put everything they will put: waiting for them first leaves no race with a disconnect.
        wait = self.drain_wait_s
        if spec.continue_buffered and buffer is not None and not await self.buffers.wait_drains(buffer, wait):
            raise FailedPrecondition(
                f"another step of this caller still drains into its buffer after {wait:.0f} s"
            )
        return buffer

    async def _clients(self, spec: StepSpec) -> _StepClients:
        """The step's reward model, custom filter and environment, each probed; when one does not
        answer (FAILED_PRECONDITION naming its field) the ones already made are closed."""
        hooks.check(spec, self._reward_urls)
        clients = _StepClients(
            hooks.reward(spec, self.plugins) or self._rewards(spec.reward),
            hooks.custom_filter(spec, self.plugins, self._remote_filters),
        )
        try:
            for client, field_name in ((clients.model, "reward.url"), (clients.custom, "filter.url")):
                try:
                    await getattr(client, "probe", _no_probe)()
                except RewardUnavailable as exc:
                    raise FailedPrecondition(f"{field_name}: {exc}") from exc
            clients.env = await self._environment(spec)
        except BaseException:
            await clients.close()
            raise
        return clients

    async def _environment(self, spec: StepSpec) -> Environment | None:
        """The step's environment client, probed (FAILED_PRECONDITION naming `episode.url`)."""
        if spec.episode is None or self._environments is None:
            return None
        env = self._environments(spec.episode)
        try:
            await env.probe()
        except EnvUnavailable as exc:
            await env.close()
            raise FailedPrecondition(f"episode.url: {exc}") from exc
        return env

    def precheck(self, counts: StepCounts) -> None:
        """The checks that need only the request's counts, made by the front door on the wire
        message before it converts anything (INVALID_ARGUMENT naming the field)."""
        owner = current_caller().identity
        # The buffered count is not read here (this check is sync and the store may be remote):
        # counted as large as it may be, and checked exactly by `_check` once the store is read.
        check_counts(counts, MAX_GROUPS)
        self._check_share(counts, owner)

    def prompt_token_limit(self) -> int:
        """The most tokens a step's prompt (or partial sample) may hold: the largest
        `max_model_len` an engine reports (a longer prompt cannot run anywhere), or
        `UNKNOWN_CONTEXT_TOKENS` when none does."""
        lengths = [
            e.capabilities.max_model_len
            for e in self._rollout.pool.engines
            if e.capabilities is not None and e.capabilities.max_model_len
        ]
        return max(lengths) if lengths else UNKNOWN_CONTEXT_TOKENS

    async def _check(self, spec: StepSpec, buffer: str | None) -> None:
        """Every check made before anything is generated (INVALID_ARGUMENT naming the field)."""
        owner = current_caller().identity
        held = await self.buffers.store.holding(buffer) if buffer is not None else None
        check(spec, held.count if held is not None else 0)
        if spec.filter is FilterKind.REWARD_NONZERO_STD:
            if spec.reward.kind is RewardKind.NONE and spec.episode is None:  # episodes: the env's
                raise InvalidArgument(
                    "filter.kind", "REWARD_NONZERO_STD needs a reward (reward.kind is unset)"
                )
            if spec.n_samples_per_prompt < 2:
                raise InvalidArgument("filter.kind", "REWARD_NONZERO_STD needs n_samples_per_prompt >= 2")
        self._check_share(StepCounts.of(spec), owner)
        if spec.continue_buffered and held is not None:
            buffered = held.indexes
            for i, group in enumerate(spec.groups):
                if group.group_index in buffered:
                    raise InvalidArgument(
                        f"groups[{i}].group_index",
                        f"group {group.group_index} is also in your buffer (continue_buffered)",
                    )
        if spec.reward.batch_group and (
            spec.reward.kind is not RewardKind.REMOTE or spec.reward_scope is not RewardScope.GROUP
        ):
            raise InvalidArgument("reward.batch_group", "applies only to a REMOTE reward with scope GROUP")
        if spec.episode is not None and self._environments is None:
            raise InvalidArgument("episode", "this replica runs no episode environments")
        episodes.check(spec, self._env_urls)
        url = spec.reward.url
        if spec.reward.kind is RewardKind.REMOTE and not reward_urls.allowed(url, self._reward_urls):
            raise InvalidArgument(
                "reward.url", f"{url!r} is not a reward URL this replica allows (--reward-url)"
            )

    def _share_groups(self, spec: StepSpec, owner: str) -> int:
        """Groups of this step the caller's share of generations holds at once (0: no cap)."""
        cap = self._rollout.registry.per_owner_limit
        if cap is None or owner == ANONYMOUS.identity:
            return 0
        return max(1, cap // spec.n_samples_per_prompt)

    def _check_share(self, counts: StepCounts, owner: str) -> None:
        """A step whose groups in flight need more generations than the caller may hold would fail
        its groups one by one on the per-caller cap: refuse it up front instead."""
        cap = self._rollout.registry.per_owner_limit
        if cap is None or owner == ANONYMOUS.identity:
            return
        groups = counts.max_groups_in_flight or counts.target_groups or counts.groups
        n = counts.n_samples_per_prompt
        if groups * n > cap:
            raise InvalidArgument(
                "max_groups_in_flight",
                f"{groups} groups of {n} samples exceed this caller's share of "
                f"{cap} generations in flight (max_in_flight_per_caller); lower max_groups_in_flight",
            )


@dataclass(slots=True)
class _StepClients:
    """The HTTP-backed helpers one step makes and closes: its reward model, custom filter and
    episode environment (each None when the step has none)."""

    model: RewardModel | None
    custom: GroupFilter | None
    env: Environment | None = None

    async def close(self) -> None:
        for client in (self.model, self.custom, self.env):
            if client is not None:
                await client.close()


class _Step:
    """The state of one running step."""

    def __init__(
        self,
        runner: StepRunner,
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
        self.rollout = runner._rollout
        self.spec = spec
        self.owner = owner
        #: The store key of the caller's buffer (None: an anonymous caller that named none).
        self.buffer = buffer
        #: Held until every group this step will buffer is in the store (released by events() or
        #: by the drain of an abandoned step).
        self.lease = lease
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
        self.active: dict[int, _GroupRun] = {}
        self.events_q: asyncio.Queue[SampleEnded | _GroupDone] = asyncio.Queue()
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

    # ----------------------------------------------------------------------------- the loop

    def _on_owner_abort(self) -> None:
        if not self.stop_reason:
            self._stop_all("the caller's generations were aborted (Abort mine)")

    async def events(self) -> AsyncIterator[StepEvent]:
        self.started = True  # from here events() releases the lease (or its drain does)
        unwatch = self.rollout.owner_aborts.watch(self.owner, self._on_owner_abort)
        try:
            self._fill()
            yield self._progress()
            while self.active:
                event = await self.events_q.get()
                if isinstance(event, SampleEnded):
                    self.progress.generated += 1
                    if self.spec.stream_samples:
                        yield event
                    yield self._progress()
                    continue
                for out in await self._group_done(event):
                    yield out
                if not self.stop_reason and self._aborted_from_outside():
                    self._stop_all("the generations were aborted (Abort all)")
                if not self.stop_reason and self.rollout.closed:
                    self._stop_all("the replica is shutting down; continue the groups on another one")
                if not self.stop_reason:
                    self._fill()
                yield self._progress()
            for handed_back in await self._put_back():
                yield handed_back
            summary = await self._summary()
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

    async def _release(self) -> None:
        """The step's end (the stream is released after this): an abandoned step drains its
        groups to the buffer, still holding its lease; a finished one gives the lease back."""
        if not self.finished:
            self._abandon()
            return
        if self.lease is not None:
            # In the background: a cancelled call must not leave the lease to expire.
            self.runner.spawn(self.lease.end())
        await self._close_hooks()

    def _fill(self) -> None:
        """Start the prompt groups the over-sampling policy allows now (policy.py), unless
        staleness admission refuses new work."""
        admission = self.spec.admission
        if admission is not None:
            self.admission_refusal = admission.refusal(self.runner.versions)
            if self.admission_refusal:
                return
        counters = self.counters
        counters.accepted = self.progress.accepted
        counters.in_flight = len(self.active)
        for _ in range(self.policy.to_start(counters, len(self.queue))):
            group, regenerated = self.queue.popleft()
            counters.submitted += 1
            self._start(group, regenerated)

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
        run = _GroupRun(group, items, ids, regenerated=regenerated)
        run.task = asyncio.create_task(self._coordinate(run))
        self.active[group.group_index] = run

    async def _group_done(self, done: _GroupDone) -> list[StepEvent]:
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

    async def _leftover(self, run: _GroupRun, reason: str) -> GroupEnded:
        """A group the step stopped (or that was aborted from outside): returned or buffered."""
        group = run.group
        if self.spec.leftovers is Leftovers.BUFFER and self.buffer is not None:
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

    def _aborted_from_outside(self) -> bool:
        """An Abort(all) ended samples of this step (Abort mine stops the step at once)."""
        return self.saw_abort_all

    def _stop_all(self, reason: str) -> None:
        """Stop starting groups and abort every group in flight (their tokens come back)."""
        self.stop_reason = reason
        for run in self.active.values():
            self._stop(run)

    def _stop(self, run: _GroupRun) -> None:
        if run.stopping:
            return
        run.stopping = True
        run.stopped.set()
        self.runner.spawn(self._abort(run.request_ids))

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            await self.runner._abort_ids(request_ids)
        except Exception:  # the drain bound of Rollout.generate still ends the samples
            log.exception("step_abort_failed", step_id=self.spec.step_id)

    def _abandon(self) -> None:
        """The caller left mid-step: abort what is in flight and buffer it (and what the step took
        from the buffer but never started) from the background: nothing is lost."""
        runs = list(self.active.values())
        for run in runs:
            self._stop(run)
        unstarted = [g for g, _ in self.queue if id(g) in self.from_buffer]
        log.warning("step_abandoned", step_id=self.spec.step_id, in_flight=len(runs), owner=self.owner)
        self.runner.spawn(self._drain_to_buffer(runs, unstarted))

    async def _drain_to_buffer(self, runs: list[_GroupRun], unstarted: list[PromptGroup]) -> None:
        try:
            await self._drain_groups(runs, unstarted)
        finally:
            if self.lease is not None:
                await self.lease.end()
            await self._close_hooks()

    async def _drain_groups(self, runs: list[_GroupRun], unstarted: list[PromptGroup]) -> None:
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

    async def _close_hooks(self) -> None:
        """Close the reward model and the custom filter and the environment (their HTTP sessions)."""
        if self.model is not None:
            await self.model.close()
        if self.custom_filter is not None:
            await self.custom_filter.close()
        if self.env is not None:
            await self.env.close()

    async def _put_back(self) -> list[GroupEnded]:
        """Groups taken from the buffer and never started go back to it. They came out of this
        caller's buffer, so they fit back unless another step of the caller filled it meanwhile:
        those are reported like an abandoned step's overflow. When the store does not answer they
        are handed to the caller instead (ABORTED with their tokens, the reason naming the store)."""
        back = [g for g, _ in self.queue if id(g) in self.from_buffer]
        buffers, buffer = self.runner.buffers, self.buffer
        if not back or buffer is None:
            return []
        try:
            rejected = await buffers.put(buffer, back)
            await buffers.note_lost(buffer, [g.group_index for g in rejected])
        except StoreUnavailable as exc:
            self.queue = deque((g, r) for g, r in self.queue if id(g) not in self.from_buffer)
            return [
                GroupEnded(
                    g.group_index,
                    Outcome.ABORTED,
                    f"{exc}; returned instead",
                    g.partial,
                    self._lags(g.partial),
                )
                for g in back
            ]
        return []

    async def _summary(self) -> Summary:
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
        if buffer is not None:
            try:
                buffered, lost = await buffers.count(buffer), await buffers.take_lost(buffer)
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

    # ----------------------------------------------------------------------------- one group

    async def _coordinate(self, run: _GroupRun) -> _GroupDone:
        """Generate the group's samples, score them, decide the outcome; never raises."""
        try:
            done = await self._group(run)
        except Exception as exc:
            log.exception("step_group_failed", step_id=self.spec.step_id, group_index=run.group.group_index)
            done = _GroupDone(run, Outcome.FAILED, f"internal error: {exc!r}"[:300])
        self.events_q.put_nowait(done)
        return done

    async def _group(self, run: _GroupRun) -> _GroupDone:
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
            return _GroupDone(run, None, self.stop_reason or "stopped by the step")
        return await self._judge(run)

    async def _judge(self, run: _GroupRun) -> _GroupDone:
        """The outcome of a group whose samples all ended: failures, rewards, filter."""
        spec = self.spec
        items = run.items
        for item in items:
            if item.sample.status is Status.ABORTED:
                why = item.sample.failure_reason or "by an Abort (group, session or caller)"
                return _GroupDone(run, None, f"sample {item.index} was aborted: {why}")
        for item in items:
            if item.sample.status is Status.FAILED:
                return _GroupDone(
                    run, Outcome.FAILED, f"sample {item.index} failed: {item.sample.failure_reason}"
                )
        if self.model is None and self.env is None:
            return await self._custom_verdict(run)
        if (
            self.model is not None
            and spec.reward_scope is RewardScope.GROUP
            and not await self._score_group(run)
        ):
            return _GroupDone(run, None, self.stop_reason or "stopped by the step")
        failed = [i for i in items if i.reward_failure]
        if failed and spec.on_reward_failure is not OnRewardFailure.KEEP_UNSCORED:
            reason = f"reward of sample {failed[0].index} failed: {failed[0].reward_failure}"
            return _GroupDone(
                run, Outcome.FAILED, reason, fatal=spec.on_reward_failure is OnRewardFailure.FAIL_GROUP
            )
        rewards = [i.reward for i in items if i.reward is not None]
        drop = filters.drop_reason(spec.filter, rewards, spec.epsilon)
        if drop is not None:
            return _GroupDone(run, Outcome.FILTERED, drop)
        return await self._custom_verdict(run)

    async def _custom_verdict(self, run: _GroupRun) -> _GroupDone:
        """The custom filter's verdict (accepted without one); one that cannot decide fails the
        group and stops the step: a broken filter is not hidden behind over-sampling."""
        if self.custom_filter is None:
            return _GroupDone(run, Outcome.ACCEPTED)
        try:
            drop = await self.custom_filter.verdict(hooks.view(run.group, run.items))
        except FilterFailed as exc:
            reason = f"the filter failed: {exc}"
            return _GroupDone(run, Outcome.FAILED, reason, fatal=True, stop_reason=reason)
        if drop is not None:
            return _GroupDone(run, Outcome.FILTERED, drop)
        return _GroupDone(run, Outcome.ACCEPTED)

    async def _score_group(self, run: _GroupRun) -> bool:
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

    async def _generate(self, run: _GroupRun, item: StepSample, i: int, request_id: str) -> None:
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
