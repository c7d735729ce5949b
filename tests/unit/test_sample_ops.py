"""Budget, masks, appending and weight-version spans (slime's generate() rules)."""

from __future__ import annotations

import pytest

from rollout_grpc.server.domain import sample_ops
from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.model import Sample, SamplingParams, Status, WeightSpan


def partial(k: int) -> Sample:
    return Sample(
        prompt_ids=(1, 2, 3),
        response_ids=list(range(10, 10 + k)),
        response_length=k,
        loss_mask=[1] * k,
        rollout_log_probs=[-0.5] * k,
        status=Status.ABORTED,
    )


def test_budget_is_reduced_by_the_existing_response() -> None:
    assert sample_ops.remaining_budget(partial(4), SamplingParams(max_new_tokens=10)) == 6
    assert sample_ops.remaining_budget(partial(10), SamplingParams(max_new_tokens=10)) == 0
    assert sample_ops.remaining_budget(partial(4), SamplingParams()) is None
    with pytest.raises(InvalidArgument) as info:
        sample_ops.remaining_budget(partial(11), SamplingParams(max_new_tokens=10))
    assert info.value.field == "sampling_params.max_new_tokens"


def test_min_tokens_count_over_the_whole_sample() -> None:
    assert sample_ops.remaining_min_tokens(partial(3), SamplingParams(min_new_tokens=5)) == 2
    assert sample_ops.remaining_min_tokens(partial(8), SamplingParams(min_new_tokens=5)) == 0


def test_offpolicy_mask_zeroes_the_earlier_response() -> None:
    s = partial(3)
    sample_ops.prepare_masks(s, mask_offpolicy=True)
    sample_ops.append_tokens(s, [7, 8], [-1.0, -2.0], "ab")
    assert s.loss_mask == [0, 0, 0, 1, 1]
    assert s.response_length == 5 and s.response_ids[-2:] == [7, 8]


def test_missing_mask_means_all_trainable() -> None:
    s = partial(2)
    s.loss_mask = []
    sample_ops.prepare_masks(s, mask_offpolicy=False)
    assert s.loss_mask == [1, 1]


def test_spans_are_shifted_and_merged() -> None:
    s = Sample()
    sample_ops.add_weight_spans(s, [WeightSpan("v1", 0, 4)], 0)
    sample_ops.add_weight_spans(s, [WeightSpan("v1", 0, 3), WeightSpan("v2", 3, 5)], 4)
    assert [(w.version, w.start, w.end) for w in s.weight_versions] == [("v1", 0, 7), ("v2", 7, 9)]


@pytest.mark.parametrize(
    ("sample", "field"),
    [
        (Sample(prompt_ids=(1, -2)), "sample.tokens[1]"),
        (Sample(), "sample.tokens"),
        (
            Sample(prompt_ids=(1, 2), response_length=2, loss_mask=[1, 1], rollout_log_probs=[0, 0]),
            "sample.response_length",
        ),
        (
            Sample(
                prompt_ids=(1, 2),
                response_ids=[3],
                response_length=1,
                loss_mask=[1, 1],
                rollout_log_probs=[0],
            ),
            "sample.loss_mask",
        ),
        (
            Sample(
                prompt_ids=(1, 2), response_ids=[3], response_length=1, loss_mask=[2], rollout_log_probs=[0]
            ),
            "sample.loss_mask[0]",
        ),
        (Sample(prompt_ids=(1, 2), response_ids=[3], response_length=1), "sample.rollout_log_probs"),
        (Sample(prompt_ids=(1, 2), status=Status.FAILED), "sample.status"),
        (Sample(prompt_ids=(1, 2), status=Status.COMPLETED), "sample.response_length"),
    ],
)
def test_check_input_names_the_field(sample: Sample, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        sample_ops.check_input(sample)
    assert info.value.field == field


def test_invariants() -> None:
    s = partial(2)
    assert sample_ops.check_invariants(s) == ""
    s.rollout_log_probs.append(0.0)
    assert "invariant broken" in sample_ops.check_invariants(s)
