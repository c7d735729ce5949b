"""Pure operations on a sample: input checks, budget, appending tokens, weight-version spans.

These follow slime's `generate()` / `append_response_tokens` (docs/rollout-semantics.md §2) and are kept
free of I/O so they can be unit-tested directly.
"""

from __future__ import annotations

import copy

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.model import Finish, Sample, SamplingParams, Status, WeightSpan

#: Statuses that generate; COMPLETED and TRUNCATED samples are returned unchanged.
GENERATING = (Status.PENDING, Status.ABORTED)
FINISHED = (Status.COMPLETED, Status.TRUNCATED)


def check_input(sample: Sample) -> None:
    """Reject samples that cannot be generated or returned (INVALID_ARGUMENT naming the field)."""
    if sample.status not in GENERATING and sample.status not in FINISHED:
        try:
            name = Status(sample.status).name
        except ValueError:
            name = str(int(sample.status))
        raise InvalidArgument(
            "sample.status",
            f"must be PENDING or ABORTED to generate, or COMPLETED/TRUNCATED to pass through; got {name}",
        )
    for i, tid in enumerate(sample.iter_token_ids()):
        if tid < 0:
            raise InvalidArgument(f"sample.tokens[{i}]", f"token ids must be non-negative, got {tid}")
    if sample.response_length < 0:
        raise InvalidArgument("sample.response_length", f"must be non-negative, got {sample.response_length}")
    if sample.status in FINISHED:
        _check_finished(sample)
    elif sample.token_count:
        _check_response(sample)
    elif sample.response_length:
        raise InvalidArgument("sample.tokens", "is empty but response_length is not 0")
    elif not sample.prompt:
        raise InvalidArgument("sample.tokens", "empty sample: give prompt token ids or a prompt text")


def _check_finished(sample: Sample) -> None:
    """A COMPLETED or TRUNCATED sample passes through; it must still be a whole sample."""
    if not sample.token_count:
        raise InvalidArgument(
            "sample.tokens", f"a {sample.status.name} sample must carry its prompt and response tokens"
        )
    if sample.status == Status.COMPLETED and sample.response_length == 0:
        raise InvalidArgument(
            "sample.response_length",
            "a COMPLETED sample has at least one response token (the stop token)",
        )


def _check_response(sample: Sample) -> None:
    """A sample to generate from token ids: its response part must be consistent."""
    if sample.response_length >= sample.token_count:
        raise InvalidArgument(
            "sample.response_length",
            f"{sample.response_length} response tokens leave no prompt in {sample.token_count} tokens",
        )
    if sample.loss_mask and len(sample.loss_mask) != sample.response_length:
        raise InvalidArgument(
            "sample.loss_mask",
            f"has {len(sample.loss_mask)} entries for {sample.response_length} response tokens",
        )
    for i, value in enumerate(sample.loss_mask):
        if value not in (0, 1):
            raise InvalidArgument(f"sample.loss_mask[{i}]", f"must be 0 or 1, got {value}")
    if len(sample.rollout_log_probs) != sample.response_length:
        raise InvalidArgument(
            "sample.rollout_log_probs",
            f"has {len(sample.rollout_log_probs)} entries for {sample.response_length} response tokens",
        )


def remaining_budget(sample: Sample, params: SamplingParams) -> int | None:
    """Tokens this call may still generate: max_new_tokens - response_length (None = no limit)."""
    if params.max_new_tokens is None:
        return None
    remaining = params.max_new_tokens - sample.response_length
    if remaining < 0:
        raise InvalidArgument(
            "sampling_params.max_new_tokens",
            f"{params.max_new_tokens} is below the sample's response_length {sample.response_length}",
        )
    return remaining


def remaining_min_tokens(sample: Sample, params: SamplingParams) -> int:
    """The part of min_new_tokens not produced yet."""
    return max(0, (params.min_new_tokens or 0) - sample.response_length)


def prepare_masks(sample: Sample, mask_offpolicy: bool) -> None:
    """Materialise the loss mask (slime's None -> all ones) and apply off-policy masking."""
    if sample.response_length and (mask_offpolicy or not sample.loss_mask):
        value = 0 if mask_offpolicy else 1
        sample.loss_mask = [value] * sample.response_length


def append_tokens(sample: Sample, token_ids: list[int], logprobs: list[float], text: str) -> None:
    """Append trainable response tokens with their logprobs and text."""
    sample.response_ids.extend(token_ids)
    sample.rollout_log_probs.extend(logprobs)
    sample.loss_mask.extend([1] * len(token_ids))
    sample.response_length += len(token_ids)
    sample.response += text


def add_weight_spans(sample: Sample, spans: list[WeightSpan], offset: int) -> None:
    """Add an engine call's spans (positions relative to the call) at response position `offset`.

    Adjacent spans with the same version are joined so that continuations and failovers under one
    version read as one span.
    """
    for span in spans:
        start, end = span.start + offset, span.end + offset
        if end <= start:
            continue
        last = sample.weight_versions[-1] if sample.weight_versions else None
        if last is not None and last.version == span.version and last.end == start:
            last.end = end
        else:
            sample.weight_versions.append(WeightSpan(span.version, start, end))


def fork(sample: Sample) -> Sample:
    """A new sample of the same group: every field copied except the prompt's ids, which are
    shared (an immutable tuple). A deep copy would walk a long prompt once per sample and hold it n
    times (hardening round 3, item 2)."""
    return copy.deepcopy(sample, {id(sample.prompt_ids): sample.prompt_ids})


def finish(sample: Sample, reason: Finish, status: Status, failure: str = "") -> None:
    """Set the terminal fields of a generation call."""
    sample.finish_reason = reason
    sample.status = status
    sample.failure_reason = failure


def check_invariants(sample: Sample) -> str:
    """'' when the trainer contract holds, else what is wrong (used before returning a sample)."""
    n = sample.response_length
    if len(sample.loss_mask) != n or len(sample.rollout_log_probs) != n:
        return (
            f"invariant broken: response_length {n}, loss_mask {len(sample.loss_mask)}, "
            f"rollout_log_probs {len(sample.rollout_log_probs)}"
        )
    if sample.routed_experts is not None:
        rows = sample.routed_experts.array.shape[0]
        expected = max(0, sample.token_count - 1 - sample.routed_experts.start)
        if rows != expected:
            return f"invariant broken: routed experts rows {rows}, expected {expected}"
    return ""
