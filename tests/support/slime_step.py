"""A slime-shaped data source and slime arguments for the RolloutStep drop-in's tests."""

from __future__ import annotations

import types
from typing import Any

from rollout_grpc.integrations import slime_step
from tests.client.slime_types import Sample
from tests.support.service import PROMPT


class DataSource:
    """slime's RolloutDataSourceWithBuffer, as the rollout function uses it."""

    def __init__(self, labels: list[str], n: int) -> None:
        self.buffer: list[list[Sample]] = []
        self.fresh = [
            [
                Sample(group_index=g, index=g * n + i, tokens=list(PROMPT), prompt="2 + 2 = ?", label=label)
                for i in range(n)
            ]
            for g, label in enumerate(labels)
        ]

    def get_samples(self, count: int) -> list[list[Sample]]:
        taken, self.buffer = self.buffer[:count], self.buffer[count:]
        more = count - len(taken)
        taken += self.fresh[:more]
        self.fresh = self.fresh[more:]
        return taken

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)


def args(target: str, rm_url: str, **extra: Any) -> types.SimpleNamespace:
    base: dict[str, Any] = {
        "rollout_grpc_target": target,
        "rollout_batch_size": 2,
        "over_sampling_batch_size": 3,
        "n_samples_per_prompt": 2,
        "rollout_max_response_len": 8,
        "rollout_temperature": 1.0,
        "rm_type": "remote_rm",
        "rm_url": rm_url,
        "dynamic_sampling_filter_path": slime_step.NONZERO_STD_FILTER,
        "partial_rollout": True,
    }
    return types.SimpleNamespace(**{**base, **extra})
