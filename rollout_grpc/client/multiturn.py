"""Multi-turn rollouts over Generate, without the front door: observations in, one sample out.

A multi-turn sample is one `Sample` whose response interleaves the model's turns (loss mask 1,
their logprobs, weight-version spans) with observations the environment inserted (tool results,
the next user message, template glue: loss mask 0, logprob 0.0, no weight-version span). Recipe::

    sample = make_sample(prompt_ids, session_id="episode-7")      # session: one engine, prefix cache
    sample = await client.generate(sample, turn_params(sample, {"temperature": 1.0}, 256))
    while not done(sample):
        sample = append_observation(sample, tokenize(tool_result))  # mask 0, status PENDING
        sample = await client.generate(sample, turn_params(sample, {"temperature": 1.0}, 256, total=4096))

`max_new_tokens` of Generate counts every response token, the observations included; the
per-turn budget is therefore `response_length + turn_max_new_tokens`, which `turn_params` computes
(capped by `total`, a budget for the whole response if you want one). Weight-version spans stay
defined over generated positions only: an observation leaves a gap between two spans, so a trainer
reads "no span" as "not generated" (equivalently: loss mask 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.samples import to_params


def append_observation(sample: pb.Sample, tokens: Iterable[int]) -> pb.Sample:
    """A copy of `sample` with `tokens` appended as environment output, ready for the next turn.

    The tokens get loss mask 0 and logprob 0.0, the response length grows by their count and the
    status returns to PENDING, so Generate continues after them. `sample` must be a finished (or
    aborted) generation: its masks and logprobs cover its response.
    """
    inserted = [int(t) for t in tokens]
    if any(t < 0 for t in inserted):
        raise ValueError("observation token ids must be non-negative")
    if len(sample.rollout_log_probs) != sample.response_length:
        raise ValueError(
            f"the sample has {len(sample.rollout_log_probs)} logprobs for {sample.response_length} "
            "response tokens: append observations to a generated sample"
        )
    out = pb.Sample()
    out.CopyFrom(sample)
    if not out.loss_mask and out.response_length:
        out.loss_mask.extend([1] * out.response_length)
    out.tokens.extend(inserted)
    out.loss_mask.extend([0] * len(inserted))
    out.rollout_log_probs.extend([0.0] * len(inserted))
    if out.rollout_top_logprobs:
        out.rollout_top_logprobs.extend(pb.TopLogprobs() for _ in inserted)
    out.response_length += len(inserted)
    out.status = pb.SAMPLE_STATUS_PENDING
    out.finish_reason = pb.FINISH_REASON_UNSPECIFIED
    out.ClearField("stop_reason")
    out.failure_reason = ""
    return out


def turn_params(
    sample: pb.Sample,
    params: pb.SamplingParams | Mapping[str, Any] | None,
    turn_max_new_tokens: int,
    *,
    total: int | None = None,
) -> pb.SamplingParams:
    """`params` with `max_new_tokens` set so the next Generate produces at most this many tokens.

    With `total`, the whole response (observations included) also stays within `total` tokens.
    """
    if turn_max_new_tokens < 1:
        raise ValueError("turn_max_new_tokens must be at least 1")
    out = pb.SamplingParams()
    out.CopyFrom(to_params(params))
    limit = sample.response_length + turn_max_new_tokens
    if total is not None:
        limit = min(limit, max(total, sample.response_length))
    out.max_new_tokens = limit
    return out
