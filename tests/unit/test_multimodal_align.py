"""Placeholder realignment onto a sample's own token ids."""

from __future__ import annotations

import pytest

from rollout_grpc.server.domain import multimodal
from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.model import MultimodalFeatures, MultimodalItem
from rollout_grpc.server.engines.vllm import features as vllm

PAD = 6


def features(*ranges: tuple[int, int]) -> MultimodalFeatures:
    items = [MultimodalItem(f"h{i}", off, n, b"kw", None, PAD) for i, (off, n) in enumerate(ranges)]
    return MultimodalFeatures({"image": items})


def test_shifted_placeholders_are_moved() -> None:
    tokens = [1, 9, 9, 4, PAD, PAD, PAD, PAD, 5, 8, 4, PAD, PAD, 5]
    f = features((1, 4), (5, 2))  # rendered without the two-token prefix
    multimodal.align(f, tokens)
    assert [(i.offset, i.length) for i in f.modalities["image"]] == [(4, 4), (11, 2)]


def test_correct_offsets_are_kept() -> None:
    tokens = [4, PAD, PAD, 5]
    f = features((1, 2))
    multimodal.align(f, tokens)
    assert f.modalities["image"][0].offset == 1


def test_missing_placeholder_names_modality_and_index() -> None:
    with pytest.raises(InvalidArgument) as info:
        multimodal.align(features((1, 2), (5, 3)), [4, PAD, PAD, 5, 9, 9])
    assert info.value.field == "sample.multimodal_features[image].items[1].placeholder"


def test_vllm_encoding_roundtrip() -> None:
    f = features((1, 2))
    body = vllm.features_body(f)
    assert body["mm_placeholders"] == {"image": [{"offset": 1, "length": 2}]}
    back = vllm.features_from_body(body, [4, PAD, PAD, 5])
    assert back.modalities["image"][0].kwargs_data == b"kw"
    assert back.modalities["image"][0].placeholder_token_id == PAD
