"""The built-in dynamic filters over a finished, scored group (slime's dynamic sampling filter).

A filter returns None to keep the group, or the reason it is dropped (reported to the caller).
"""

from __future__ import annotations

import statistics

from rollout_grpc.server.rollout.step.spec import FilterKind


def reward_std_reason(rewards: list[float], epsilon: float) -> str | None:
    """DAPO's `check_reward_nonzero_std`: keep a group whose rewards vary by more than epsilon.

    The population standard deviation over the scored samples (unscored ones, kept under
    KEEP_UNSCORED, do not count); fewer than two rewards cannot vary.
    """
    std = statistics.pstdev(rewards) if len(rewards) >= 2 else 0.0
    if std > epsilon:
        return None
    return f"reward std {std:.6g} <= epsilon {epsilon:g} over {len(rewards)} rewards"


def drop_reason(kind: FilterKind, rewards: list[float], epsilon: float) -> str | None:
    """None to keep the group, else why the filter drops it."""
    if kind is FilterKind.REWARD_NONZERO_STD:
        return reward_std_reason(rewards, epsilon)
    return None
