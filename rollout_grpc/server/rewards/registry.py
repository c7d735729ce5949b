"""The one module that names the reward kinds: a `RewardConfig` -> a `RewardModel`."""

from __future__ import annotations

import math
from urllib.parse import urlsplit

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.rewards.api import RewardConfig, RewardKind, RewardModel
from rollout_grpc.server.rewards.connections import PostConnections
from rollout_grpc.server.rewards.graders import slime_hub
from rollout_grpc.server.rewards.processes import ProcessLimits, RuleProcesses
from rollout_grpc.server.rewards.remote import RemoteReward
from rollout_grpc.server.rewards.rules import ExactMatchReward, GradedReward, MathReward, math_value

#: slime's rm_hub kinds: each a pure grader `(label, response) -> float` (graders/slime_hub.py).
GRADED = {
    RewardKind.SLIME_MATH: slime_hub.math_score,
    RewardKind.DAPO: slime_hub.dapo_score,
    RewardKind.DEEPSCALER: slime_hub.deepscaler_score,
    RewardKind.F1: slime_hub.f1_score,
    RewardKind.GPQA: slime_hub.gpqa_label_score,
}
#: Kinds whose slime function answers an object: kept as the sample's reward detail.
DETAILS = {RewardKind.DAPO: slime_hub.dapo_detail}
#: The kinds that need no server (the completeness test checks every kind is built here).
RULE_KINDS = frozenset({RewardKind.MATH, RewardKind.EXACT_MATCH, *GRADED})


def rule_processes(limits: ProcessLimits | None = None) -> RuleProcesses:
    """The bounded child processes of this replica process's rule rewards (started lazily; each
    child imports math-verify before its memory cap, so the first MATH call is not slowed)."""
    return RuleProcesses(limits, warm=math_value)


def build(
    config: RewardConfig, rules: RuleProcesses, connections: PostConnections | None = None
) -> RewardModel | None:
    """The reward model of `config` (None for no reward); INVALID_ARGUMENT naming a bad field.

    `rules` runs the rule kinds (MATH, EXACT_MATCH, slime's rm_hub kinds) in bounded child processes;
    a REMOTE reward posts over `connections` (the replica's keep-alive pool) when given.
    """
    # NaN compares false with everything (it meant "no timeout"), inf failed every reward at once.
    if not math.isfinite(config.timeout_s) or config.timeout_s <= 0:
        raise InvalidArgument("reward.timeout_s", f"must be a positive finite number, got {config.timeout_s}")
    if config.kind in (RewardKind.NONE, RewardKind.PLUGIN):
        # Plugins are loaded by the replica at start and built by the step runner (step/plugins.py).
        _refuse_plugin(config)
        return None
    if config.kind is RewardKind.MATH:
        return MathReward(rules)
    if config.kind is RewardKind.EXACT_MATCH:
        return ExactMatchReward(rules)
    if config.kind in GRADED:
        return GradedReward(rules, GRADED[config.kind], DETAILS.get(config.kind))
    parts = urlsplit(config.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidArgument("reward.url", f"must be an http(s) URL for a REMOTE reward; got {config.url!r}")
    if config.max_retries < 0:
        raise InvalidArgument("reward.max_retries", f"must be non-negative, got {config.max_retries}")
    if config.max_concurrency < 1:
        raise InvalidArgument("reward.max_concurrency", f"must be at least 1, got {config.max_concurrency}")
    if not config.reward_key:
        raise InvalidArgument("reward.reward_key", "must not be empty")
    return RemoteReward(config, connections)


def _refuse_plugin(config: RewardConfig) -> None:
    """No reward (NONE); a PLUGIN is refused here: the step runner builds it from its plugins."""
    if config.kind is RewardKind.PLUGIN:
        raise InvalidArgument(
            "reward.plugin", "a plugin reward is built from the replica's --step-plugin list"
        )
