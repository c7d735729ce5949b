"""R3 decoding and merging: narrow dtypes kept, rows checked against the tokens."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from rollout_grpc.server.domain import routed_experts
from rollout_grpc.server.domain.model import RoutedExperts
from rollout_grpc.server.engines.vllm import experts


def encode(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_decode_keeps_the_engine_dtype_and_shape(dtype: type) -> None:
    array: np.ndarray = np.arange(5 * 3 * 2, dtype=dtype).reshape(5, 3, 2)
    decoded = experts.decode(encode(array))
    assert decoded.dtype == np.dtype(dtype) and decoded.shape == (5, 3, 2)
    assert np.array_equal(decoded, array)


def test_decode_rejects_garbage() -> None:
    with pytest.raises(routed_experts.RoutedExpertsError):
        experts.decode("not base64!")
    with pytest.raises(routed_experts.RoutedExpertsError):
        experts.decode(encode(np.zeros((4, 2), dtype=np.uint8)))


def test_fresh_rows_must_cover_every_token_but_the_last() -> None:
    new = np.zeros((9, 2, 2), dtype=np.uint8)
    assert routed_experts.merge(None, new, 0, 10).array.shape == (9, 2, 2)
    with pytest.raises(routed_experts.RoutedExpertsError, match="expected 10"):
        routed_experts.merge(None, new, 0, 11)


def test_start_reuses_the_old_prefix() -> None:
    old = RoutedExperts(np.full((9, 2, 2), 7, dtype=np.uint8), 0)
    new = np.full((6, 2, 2), 1, dtype=np.uint8)
    merged = routed_experts.merge(old, new, 4, 11)
    assert merged.start == 0 and merged.array.shape == (10, 2, 2)
    assert (merged.array[:4] == 7).all() and (merged.array[4:] == 1).all()


def test_start_without_old_routing_keeps_the_start() -> None:
    merged = routed_experts.merge(None, np.zeros((6, 2, 2), dtype=np.uint8), 4, 11)
    assert merged.start == 4 and merged.array.shape[0] == 11 - 1 - 4
