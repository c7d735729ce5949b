"""Server-side step plugins: a custom reward and a custom filter the operator installs.

A plugin is a Python entry point of an installed distribution, in the group
`rollout_grpc.step_rewards` (a reward) or `rollout_grpc.step_filters` (a filter). Installing a
distribution exposes nothing: the operator enables plugins by name (`--step-plugin NAME`,
repeatable; `*` for every installed one), and a step names the one it wants (`reward.plugin`,
`filter.plugin`). An unknown name at start stops the replica with the installed names; an unknown
or disabled name on a step is INVALID_ARGUMENT naming the field.

Contracts (docs/rollout-step.md "Plugins"):

* reward: `fn(request: RewardRequest) -> float | Mapping` (or a coroutine function): a number, or
  an object whose "reward" is the number (the object becomes the sample's reward detail).
* filter: `fn(group: FilterGroup) -> bool | str` (or a coroutine function): True keeps the group,
  False drops it, a non-empty string drops it with that reason.

Why threads and timeouts: a plugin is the operator's code in the replica's process. A plain
function runs in a worker thread (a CPU-heavy grader must not stall every stream of the event
loop), a coroutine function on the loop; both are bounded by `PLUGIN_TIMEOUT_S` and
`PLUGIN_CONCURRENCY`. A plugin that raises, times out or returns something else fails that
sample's reward (`on_failure` applies) or that group's filter (the step stops): never a silent
score or verdict.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.rewards.api import (
    FilterFailed,
    FilterGroup,
    FilterVerdict,
    RewardFailed,
    RewardOutcome,
    RewardRequest,
    RewardResult,
)

#: Entry point group of reward plugins.
REWARD_GROUP = "rollout_grpc.step_rewards"
#: Entry point group of filter plugins.
FILTER_GROUP = "rollout_grpc.step_filters"
#: `--step-plugin *`: every installed plugin.
ALL = "*"
#: Seconds one plugin call may take before its sample (or group) fails.
PLUGIN_TIMEOUT_S = 30.0
#: Plugin calls at once per step (threads of the default executor are shared by the process).
PLUGIN_CONCURRENCY = 8
#: Characters of a failure reason or drop reason kept.
MAX_REASON_CHARS = 512
#: Bytes of JSON of a reward plugin's detail returned to the caller (as a remote reward's).
MAX_DETAIL_BYTES = 16 << 10


class PluginError(ValueError):
    """The operator enabled a plugin that is not installed or does not load (the replica stops)."""


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."


async def _call(fn: Callable[..., Any], arg: object, limit: asyncio.Semaphore) -> Any:
    """`fn(arg)` bounded in time and concurrency: a coroutine function on the loop, a plain function
    in a worker thread (a thread that overruns is left to finish; its result is ignored)."""
    async with limit:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(arg), PLUGIN_TIMEOUT_S)
        result = await asyncio.wait_for(asyncio.to_thread(fn, arg), PLUGIN_TIMEOUT_S)
        if inspect.isawaitable(result):  # a callable object whose __call__ is async
            return await asyncio.wait_for(result, PLUGIN_TIMEOUT_S)
        return result


def _failure(kind: str, name: str, exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"{kind} plugin {name!r} took longer than {PLUGIN_TIMEOUT_S:g} s"
    return _cut(f"{kind} plugin {name!r} raised {exc!r}")


@dataclass(slots=True, eq=False)
class PluginReward:
    """A reward plugin as the step's reward model (one per step)."""

    name: str
    fn: Callable[..., Any]
    limit: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(PLUGIN_CONCURRENCY))

    async def probe(self) -> None:
        """Nothing to reach: the plugin loaded at start."""

    async def score(self, request: RewardRequest) -> RewardOutcome:
        try:
            answer = await _call(self.fn, request, self.limit)
        except Exception as exc:
            return RewardFailed(_failure("reward", self.name, exc))
        return self._read(answer)

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardOutcome]:
        return list(await asyncio.gather(*(self.score(r) for r in requests)))

    async def close(self) -> None:
        """Nothing held."""

    def _read(self, answer: object) -> RewardOutcome:
        detail: dict[str, object] | None = None
        value = answer
        if isinstance(answer, Mapping):
            value = answer.get("reward")
            try:
                encoded = json.dumps(answer)
            except (TypeError, ValueError):
                return RewardFailed(f"reward plugin {self.name!r} returned a detail that is not JSON")
            if len(encoded) <= MAX_DETAIL_BYTES:
                detail = json.loads(encoded)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return RewardFailed(
                _cut(
                    f"reward plugin {self.name!r} returned {value!r}; expected a finite number "
                    "(or an object whose 'reward' is one)"
                )
            )
        return RewardResult(float(value), detail)


@dataclass(slots=True, eq=False)
class PluginFilter:
    """A filter plugin as the step's custom filter (one per step)."""

    name: str
    fn: Callable[..., Any]
    limit: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(PLUGIN_CONCURRENCY))

    async def verdict(self, group: FilterGroup) -> FilterVerdict:
        try:
            answer = await _call(self.fn, group, self.limit)
        except Exception as exc:
            raise FilterFailed(_failure("filter", self.name, exc)) from None
        if answer is True:
            return None
        if answer is False:
            return f"filter plugin {self.name!r} dropped the group"
        if isinstance(answer, str) and answer:
            return _cut(f"filter plugin {self.name!r}: {answer}")
        raise FilterFailed(
            _cut(f"filter plugin {self.name!r} returned {answer!r}; expected True, False or a reason string")
        )

    async def close(self) -> None:
        """Nothing held."""


@dataclass(frozen=True, slots=True)
class StepPlugins:
    """The plugins the operator enabled on this replica, loaded at start."""

    rewards: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    filters: Mapping[str, Callable[..., Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, enabled: Iterable[str]) -> StepPlugins:
        """Load the enabled plugins (`--step-plugin`); PluginError naming an unknown or broken one."""
        names = set(enabled)
        if not names:
            return cls()
        installed = {
            group: {ep.name: ep for ep in entry_points(group=group)} for group in (REWARD_GROUP, FILTER_GROUP)
        }
        known = set(installed[REWARD_GROUP]) | set(installed[FILTER_GROUP])
        unknown = sorted(names - known - {ALL})
        if unknown:
            raise PluginError(
                f"--step-plugin: no installed plugin named {', '.join(map(repr, unknown))} "
                f"(installed: {', '.join(sorted(known)) or 'none'}; entry point groups "
                f"{REWARD_GROUP}, {FILTER_GROUP})"
            )
        every = ALL in names
        return cls(
            rewards=_load(installed[REWARD_GROUP], names, every),
            filters=_load(installed[FILTER_GROUP], names, every),
        )

    def reward(self, name: str) -> PluginReward:
        """The reward plugin `name` for one step; INVALID_ARGUMENT on `reward.plugin` when unknown."""
        return PluginReward(name, _pick(self.rewards, name, "reward.plugin", "reward"))

    def filter(self, name: str) -> PluginFilter:
        """The filter plugin `name` for one step; INVALID_ARGUMENT on `filter.plugin` when unknown."""
        return PluginFilter(name, _pick(self.filters, name, "filter.plugin", "filter"))


def _load(group: Mapping[str, EntryPoint], names: set[str], every: bool) -> dict[str, Callable[..., Any]]:
    loaded: dict[str, Callable[..., Any]] = {}
    for name, point in group.items():
        if not every and name not in names:
            continue
        try:
            fn = point.load()
        except Exception as exc:
            raise PluginError(
                f"--step-plugin {name}: entry point {point.value!r} does not load: {exc!r}"
            ) from exc
        if not callable(fn):
            raise PluginError(f"--step-plugin {name}: entry point {point.value!r} is not callable")
        loaded[name] = fn
    return loaded


def _pick(
    plugins: Mapping[str, Callable[..., Any]], name: str, field_name: str, kind: str
) -> Callable[..., Any]:
    if not name:
        raise InvalidArgument(field_name, f"names the {kind} plugin and must be set with kind PLUGIN")
    fn = plugins.get(name)
    if fn is None:
        enabled = ", ".join(sorted(plugins)) or "none"
        raise InvalidArgument(
            field_name, f"no {kind} plugin named {name!r} is enabled on this replica (enabled: {enabled})"
        )
    return fn
