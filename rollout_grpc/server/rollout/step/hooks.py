"""The step's hooks: per-group sampling parameters, a custom reward and a custom filter.

What the runner asks of them lives here, so runner.py only calls in: the checks made before
anything generates (each naming its field), building the step's custom reward (a plugin) and
custom filter (a plugin or a remote callable, built by the wiring's factory since only the rewards
package speaks HTTP), and the view of a group a custom filter sees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout_grpc.server.domain import params as params_mod
from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.rewards import allowlist as reward_urls
from rollout_grpc.server.rewards.api import (
    FilterGroup,
    GroupFilter,
    RemoteFilterConfig,
    RewardKind,
    RewardModel,
)
from rollout_grpc.server.rollout.step.plugins import StepPlugins
from rollout_grpc.server.rollout.step.spec import FilterKind, PromptGroup, StepSample, StepSpec

#: Builds a step's remote filter (the wiring passes `rewards.remote_filter.build`).
RemoteFilterFactory = Callable[[RemoteFilterConfig], GroupFilter]


def check(spec: StepSpec, allowed_urls: Sequence[str]) -> None:
    """Refuse bad hooks before anything generates (INVALID_ARGUMENT naming the field)."""
    _check_group_params(spec)
    _check_filter(spec, allowed_urls)


def _check_group_params(spec: StepSpec) -> None:
    """Each group's own sampling parameters, as the step's are checked (naming the group)."""
    for i, group in enumerate(spec.groups):
        if group.params is None:
            continue
        try:
            params_mod.validate(group.params, skip_text=spec.options.skip_text)
        except InvalidArgument as exc:
            raise InvalidArgument(f"groups[{i}].{exc.field}", exc.description) from None
        seed = group.params.seed
        if seed is not None and seed + spec.n_samples_per_prompt - 1 >= 2**63:
            raise InvalidArgument(
                f"groups[{i}].sampling_params.seed", "base seed + n_samples_per_prompt overflows"
            )


def _check_filter(spec: StepSpec, allowed_urls: Sequence[str]) -> None:
    """Plugin names only with kind PLUGIN, a URL only with REMOTE (and an allowed one)."""
    if spec.reward.kind is not RewardKind.PLUGIN and spec.reward.plugin:
        raise InvalidArgument("reward.plugin", "is read only with reward.kind PLUGIN")
    if spec.filter is not FilterKind.PLUGIN and spec.filter_plugin:
        raise InvalidArgument("filter.plugin", "is read only with filter.kind PLUGIN")
    if spec.filter is not FilterKind.REMOTE and spec.remote_filter is not None:
        raise InvalidArgument("filter.url", "is read only with filter.kind REMOTE")
    if spec.filter is FilterKind.REMOTE:
        url = spec.remote_filter.url if spec.remote_filter is not None else ""
        if not url:
            raise InvalidArgument("filter.url", "is required with filter.kind REMOTE")
        if not reward_urls.allowed(url, allowed_urls):
            raise InvalidArgument("filter.url", f"{url!r} is not a URL this replica allows (--reward-url)")


def reward(spec: StepSpec, plugins: StepPlugins) -> RewardModel | None:
    """The step's plugin reward, or None when the reward is not a plugin."""
    if spec.reward.kind is not RewardKind.PLUGIN:
        return None
    return plugins.reward(spec.reward.plugin)


def custom_filter(
    spec: StepSpec, plugins: StepPlugins, remote: RemoteFilterFactory | None
) -> GroupFilter | None:
    """The step's custom filter (plugin or remote), or None for a built-in one."""
    if spec.filter is FilterKind.PLUGIN:
        return plugins.filter(spec.filter_plugin)
    if spec.filter is FilterKind.REMOTE:
        if remote is None or spec.remote_filter is None:
            raise InvalidArgument("filter.kind", "REMOTE filters are not wired on this replica")
        return remote(spec.remote_filter)
    return None


def view(group: PromptGroup, items: list[StepSample]) -> FilterGroup:
    """What a custom filter sees of a finished group (text, rewards, statuses; no token ids)."""
    return FilterGroup(
        group_index=group.group_index,
        prompt=group.prompt.prompt or "",
        label=group.label,
        responses=[i.sample.response for i in items],
        rewards=[i.reward for i in items],
        statuses=[i.sample.status.name.lower() for i in items],
    )
