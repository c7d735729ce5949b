"""R3 routed experts in the domain: validate a sample's rows and merge them across engine calls.

An engine adapter decodes its own wire encoding (vLLM's is in `engines/vllm/experts.py`) into a
`[positions, layers, topk]` array of a supported dtype; from there on the rows are engine-neutral.
The array is kept in the engine's dtype (never widened) and its shape is taken from the array
itself, never reshaped from model-config arguments, which a dense model does not have.
"""

from __future__ import annotations

import numpy as np

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.model import GenerateOptions, RoutedExperts

#: Element types the contract can carry (rollout.v1.DType).
SUPPORTED_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))


class RoutedExpertsError(ValueError):
    """The engine's routed experts are malformed or do not match the sample."""


def merge(previous: RoutedExperts | None, new: np.ndarray, start: int, num_tokens: int) -> RoutedExperts:
    """The sample's routing after a call whose engine array starts at position `start`.

    A continuation re-prefills the whole sequence, so with `start == 0` the new array replaces the
    old one. With `start > 0` (multi-turn reuse: vLLM's `routed_experts_prompt_start`) the result is
    `old[:start] + new` when the sample already has routing from position 0, and otherwise the new
    rows alone, starting at `start`. Either way the rows must cover every token but the last:
    `rows == num_tokens - 1 - result.start`.
    """
    result_start = start
    array = new
    if start > 0 and previous is not None:
        if previous.start != 0 or previous.array.shape[0] < start:
            raise RoutedExpertsError(
                f"routed experts start at position {start} but the sample's routing covers positions "
                f"[{previous.start}, {previous.start + previous.array.shape[0]})"
            )
        if previous.array.shape[1:] != new.shape[1:] or previous.array.dtype != new.dtype:
            raise RoutedExpertsError(
                f"routed experts of shape {new.shape[1:]} {new.dtype} cannot extend "
                f"{previous.array.shape[1:]} {previous.array.dtype}"
            )
        array = np.concatenate([previous.array[:start], new])
        result_start = 0
    expected = max(0, num_tokens - 1 - result_start)
    if array.shape[0] != expected:
        raise RoutedExpertsError(
            f"routed experts cover {array.shape[0]} positions from {result_start} but the sample has "
            f"{num_tokens} tokens (expected {expected}: every token but the last)"
        )
    return RoutedExperts(array=array, start=result_start)


def check_input(given: RoutedExperts | None, tokens: int, options: GenerateOptions) -> None:
    """Reject R3 input that a generation could only fail on afterwards (INVALID_ARGUMENT, no engine call).

    The sample's routing may cover fewer positions than its tokens (a trainer appended a turn) but
    never more, and an engine array starting at `options.routed_experts_start` must find the
    positions before it in the sample's routing from position 0. `tokens` is the sample's count
    of token ids (prompt and response).
    """
    start = options.routed_experts_start
    if start < 0:
        raise InvalidArgument("options.routed_experts_start", f"must be non-negative, got {start}")
    if options.return_routed_experts and tokens and start > tokens:
        raise InvalidArgument("options.routed_experts_start", f"{start} is beyond the {tokens} input tokens")
    if given is None:
        return
    if given.start < 0:
        raise InvalidArgument("sample.routed_experts.start", f"must be non-negative, got {given.start}")
    rows, limit = given.array.shape[0], max(0, tokens - 1 - given.start)
    if rows > limit:
        raise InvalidArgument(
            "sample.routed_experts.shape",
            f"{rows} rows from position {given.start} exceed the {limit} positions of the sample's "
            f"{tokens} tokens (every token but the last)",
        )
    if options.return_routed_experts and start > 0 and (given.start != 0 or rows < start):
        raise InvalidArgument(
            "sample.routed_experts",
            f"options.routed_experts_start {start} needs the sample's routing from position 0 through "
            f"{start}, but it covers [{given.start}, {given.start + rows})",
        )
