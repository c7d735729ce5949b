"""Every reward kind of the proto is named where it must be: the wire mapping, the registry, and
docs/rollout-step.md's table (a kind added in one place and forgotten in another fails here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.front.grpc import convert
from rollout_grpc.server.rewards import registry
from rollout_grpc.server.rewards.api import RewardConfig, RewardKind
from rollout_grpc.server.rewards.processes import RuleProcesses

DOC = Path(__file__).resolve().parents[2] / "docs" / "rollout-step.md"
KINDS = [v.name for v in pb.RewardKind.DESCRIPTOR.values if v.number != 0]


@pytest.mark.parametrize("name", KINDS)
def test_every_proto_kind_maps_builds_and_is_documented(name: str) -> None:
    kind = convert._REWARD_KINDS[pb.RewardKind.Value(name)]
    config = RewardConfig(kind=kind, url="http://rm.example:8000/score")
    if kind is RewardKind.PLUGIN:  # built from the replica's plugins (tests/integration/test_step_hooks.py)
        with pytest.raises(InvalidArgument, match=r"reward\.plugin"):
            registry.build(config, RuleProcesses())
    else:
        assert registry.build(config, RuleProcesses()) is not None, (
            f"{name} has no reward model in rewards/registry.py"
        )
    rows = [line for line in DOC.read_text().splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"{name} needs exactly one row in docs/rollout-step.md's reward kinds table"


def test_every_domain_kind_is_reachable_from_the_wire() -> None:
    assert set(convert._REWARD_KINDS.values()) == set(RewardKind)
    assert registry.RULE_KINDS | {RewardKind.REMOTE, RewardKind.NONE, RewardKind.PLUGIN} == set(RewardKind)


async def test_dapo_keeps_slimes_whole_answer_as_the_reward_detail() -> None:
    from rollout_grpc.server.rewards.api import RewardRequest, RewardResult

    rules = RuleProcesses()
    model = registry.build(RewardConfig(kind=RewardKind.DAPO), rules)
    assert model is not None
    try:
        outcome = await model.score(RewardRequest(prompt="", response="so\nAnswer: 12", label="12"))
    finally:
        await rules.close()
    assert isinstance(outcome, RewardResult)
    assert outcome.value == 1.0 and outcome.detail == {"score": 1.0, "acc": True, "pred": "12"}
