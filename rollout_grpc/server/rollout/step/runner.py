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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument
from rollout_grpc.server.domain.identity import ANONYMOUS, current_caller
from rollout_grpc.server.envs.api import Environment, EnvUnavailable, EpisodeConfig
from rollout_grpc.server.rewards import allowlist as reward_urls
from rollout_grpc.server.rewards.api import (
    GroupFilter,
    RewardConfig,
    RewardKind,
    RewardModel,
    RewardUnavailable,
)
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.step import episodes, hooks
from rollout_grpc.server.rollout.step.buffer import StepBuffers, buffer_owner
from rollout_grpc.server.rollout.step.events import StepEvent
from rollout_grpc.server.rollout.step.loop import Step
from rollout_grpc.server.rollout.step.plugins import StepPlugins
from rollout_grpc.server.rollout.step.spec import (
    MAX_GROUPS,
    UNKNOWN_CONTEXT_TOKENS,
    FilterKind,
    Leftovers,
    RewardScope,
    StepCounts,
    StepSpec,
    check,
    check_counts,
)
from rollout_grpc.server.rollout.step.state import keeps_buffer
from rollout_grpc.server.rollout.step.versions import FleetVersions

log = structlog.get_logger(__name__)

#: Builds the reward model of a step (the wiring passes `rewards.registry.build`).
RewardFactory = Callable[[RewardConfig], RewardModel | None]
#: Builds the environment client of an episode step (the wiring passes `envs.remote.RemoteEnvironment`).
EnvFactory = Callable[[EpisodeConfig], Environment]
#: Aborts request ids of the current caller (the wiring passes `Control.abort_ids`).
AbortIds = Callable[[list[str]], Awaitable[object]]


async def _no_probe() -> None:
    """A custom filter with nothing to probe (a plugin)."""


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

    @property
    def rollout(self) -> Rollout:
        """The Generate use case the step's samples go through."""
        return self._rollout

    async def abort_ids(self, request_ids: list[str]) -> object:
        """Abort the current caller's generations `request_ids` (a stopped group's samples)."""
        return await self._abort_ids(request_ids)

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
        # A RETURN step that continues nothing keeps nothing in the store: no lease (its caller
        # leaving mid-step takes one then, drain.py), no store round trip on its path.
        lease = await self.buffers.lease(buffer) if buffer is not None and keeps_buffer(spec) else None
        try:
            buffered = await self.buffers.take(buffer, lease) if spec.continue_buffered and buffer else []
        except BaseException:
            if lease is not None:
                await lease.end()
            await clients.close()
            raise
        step = Step(
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
        # The buffered count matters only to a continue step (the supply it adds, the index clash).
        held = (
            await self.buffers.store.holding(buffer)
            if buffer is not None and spec.continue_buffered
            else None
        )
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
