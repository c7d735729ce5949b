"""slime's `--rollout-function-path` drop-in on RolloutStep: a slime-shaped data source and Samples
(tests/client/slime_types.py), a real replica on simulated engines and a real HTTP reward model."""

from __future__ import annotations

import asyncio
import types

import pytest

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.integrations import slime_step
from tests.client.slime_types import Sample
from tests.harness import harness
from tests.support.reward_server import RewardServer
from tests.support.service import PROMPT
from tests.support.slime_step import DataSource, args


async def test_the_rollout_function_over_samples_filters_and_fills_slime_samples() -> None:
    async with harness("sim") as h, RewardServer() as rm:
        source = DataSource(["one", "alternate", "one", "alternate", "alternate"], n=2)
        groups = await asyncio.to_thread(slime_step.generate_rollout, args(h.target, rm.url), 7, source)
        assert rm.requests and all(r["prompt"] == "2 + 2 = ?" for r in rm.requests)
    assert len(groups) == 2
    for group in groups:
        assert [s.label for s in group] == ["alternate", "alternate"]
        assert sorted(s.reward for s in group) == [0.0, 1.0]
        for sample in group:
            assert sample.status is Sample.Status.TRUNCATED and sample.response_length == 8
            assert len(sample.loss_mask) == len(sample.rollout_log_probs) == 8
    assert [g[0].index for g in groups] == sorted(g[0].index for g in groups)


@pytest.mark.parametrize(
    ("rm_type", "kind"),
    [
        ("math", "REWARD_KIND_SLIME_MATH"),
        ("dapo", "REWARD_KIND_DAPO"),
        ("deepscaler", "REWARD_KIND_DEEPSCALER"),
        ("f1", "REWARD_KIND_F1"),
        ("gpqa", "REWARD_KIND_GPQA"),
    ],
)
def test_slimes_rule_rm_types_map_to_the_kinds_with_slimes_verdicts(rm_type: str, kind: str) -> None:
    spec = slime_step.reward_of(types.SimpleNamespace(rm_type=rm_type))
    assert spec.kind == pb.RewardKind.Value(kind)


def test_settings_the_service_cannot_run_are_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="--rm-type 'boxed_f1'"):
        slime_step.reward_of(types.SimpleNamespace(rm_type="boxed_f1"))
    with pytest.raises(ValueError, match="--rm-type ''"):
        slime_step.reward_of(types.SimpleNamespace(rm_type=None))
    with pytest.raises(ValueError, match="--dynamic-sampling-filter-path"):
        slime_step.filter_of(types.SimpleNamespace(dynamic_sampling_filter_path="my.filter"))


async def test_partial_rollout_buffers_the_aborted_groups_and_the_next_rollout_continues_them() -> None:
    async with (
        harness("sim", sim_config={"token_delay_s": 0.005, "eos_probability": 0.0}) as h,
        RewardServer() as rm,
    ):
        source = DataSource(["alternate"] * 3, n=2)
        for sample in source.fresh[0]:  # group 0 is nearly done: it is accepted first
            sample.tokens = [*PROMPT, *([5] * 295)]
            sample.response, sample.response_length = "x" * 295, 295
            sample.loss_mask, sample.rollout_log_probs = [1] * 295, [-1.0] * 295
            sample.status = Sample.Status.ABORTED
        setup = args(
            h.target,
            rm.url,
            rollout_batch_size=1,
            rollout_max_response_len=300,
            dynamic_sampling_filter_path=None,
            mask_offpolicy_in_partial_rollout=True,
        )
        first = await asyncio.to_thread(slime_step.generate_rollout, setup, 7, source)
        assert [g[0].group_index for g in first] == [0]
        assert sorted(g[0].group_index or 0 for g in source.buffer) == [1, 2]
        partial = {s.index: list(s.tokens) for g in source.buffer for s in g}
        for group in source.buffer:
            for sample in group:
                assert sample.status is Sample.Status.ABORTED and 0 < sample.response_length < 300
                assert sample.metadata["start_rollout_id"] == 7
        setup.rollout_batch_size = 2
        second = await asyncio.to_thread(slime_step.generate_rollout, setup, 8, source)
    assert sorted(g[0].group_index or 0 for g in second) == [1, 2]
    for group in second:
        for sample in group:
            assert (
                sample.response_length == 300
                and sample.tokens[: len(partial[sample.index])] == partial[sample.index]
            )
            assert sample.metadata["start_rollout_id"] == 7
            done = len(partial[sample.index]) - len(PROMPT)
            assert sample.loss_mask == [0] * done + [1] * (300 - done)
