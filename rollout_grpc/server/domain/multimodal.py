"""Multimodal features: realign placeholder ranges onto a sample's tokens and check payloads.

A sample's features come from Render, but its token ids may since have changed (a continuation
appends the partial response; a trainer may add a prefix). Before generating, every item's range
is moved onto the run of its placeholder token in the sample's own ids, searching forward in
placeholder order (vime's `_align_mm_feature_placeholders_to_tokens`), so the engine sees exactly
the tokens the trainer will train on with the features pointing at the right offsets. The engine
wire format of features lives in the engine adapter (`vllm.features_body`).
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.model import MultimodalFeatures


def _is_run(tokens: Sequence[int], start: int, length: int, token_id: int) -> bool:
    """tokens[start:start+length] is exactly a maximal run of `token_id`."""
    end = start + length
    if start < 0 or end > len(tokens) or length <= 0:
        return False
    if any(t != token_id for t in tokens[start:end]):
        return False
    before_ok = start == 0 or tokens[start - 1] != token_id
    after_ok = end == len(tokens) or tokens[end] != token_id
    return before_ok and after_ok


def _find_run(tokens: Sequence[int], length: int, token_id: int, cursor: int) -> int:
    """First position >= cursor of a maximal run of exactly `length` copies of `token_id`, or -1."""
    i = cursor
    n = len(tokens)
    while i < n:
        if tokens[i] != token_id:
            i += 1
            continue
        j = i
        while j < n and tokens[j] == token_id:
            j += 1
        if j - i == length:
            return i
        i = j
    return -1


def align(features: MultimodalFeatures, tokens: Sequence[int]) -> None:
    """Move every item's placeholder onto its run in `tokens` (in place).

    Raises InvalidArgument naming the modality and item index when a placeholder run cannot be found.
    """
    for modality, items in features.modalities.items():
        cursor = 0
        for index, item in sorted(enumerate(items), key=lambda pair: pair[1].offset):
            field = f"sample.multimodal_features[{modality}].items[{index}]"
            if item.length <= 0:
                raise InvalidArgument(field + ".placeholder.length", f"must be positive, got {item.length}")
            if (
                not _is_run(tokens, item.offset, item.length, item.placeholder_token_id)
                or item.offset < cursor
            ):
                found = _find_run(tokens, item.length, item.placeholder_token_id, cursor)
                if found < 0:
                    raise InvalidArgument(
                        field + ".placeholder",
                        f"no run of {item.length} placeholder tokens (id {item.placeholder_token_id}) for "
                        f"{modality} item {index} in the sample's tokens at or after position {cursor}",
                    )
                item.offset = found
            cursor = item.offset + item.length


def hashes(features: MultimodalFeatures) -> list[str]:
    """Every item's content hash."""
    return [item.mm_hash for items in features.modalities.values() for item in items]


def has_all_kwargs(features: MultimodalFeatures) -> bool:
    """Every item carries its processed tensors (so it can be resent to any engine)."""
    return all(item.kwargs_data is not None for items in features.modalities.values() for item in items)
