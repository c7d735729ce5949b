"""vLLM's routed-experts encoding: base64 of `np.save(array)`, decoded to the domain's array.

vLLM 0.32 returns `choices[i].routed_experts` with shape `[prompt_len - start + n_out - 1,
num_layers, topk]` and dtype uint8 (<= 256 experts) or uint16. The decoded array is little-endian
and contiguous; merging and row checks are the domain's (`domain/routed_experts.py`).
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from rollout_grpc.server.domain.routed_experts import SUPPORTED_DTYPES, RoutedExpertsError


def decode(encoded: str) -> np.ndarray:
    """Decode vLLM's base64 `.npy` into a little-endian 3-D array of a supported dtype."""
    try:
        raw = base64.b64decode(encoded, validate=True)
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise RoutedExpertsError(f"routed_experts is not a base64 .npy array: {exc}") from exc
    if array.ndim != 3:
        raise RoutedExpertsError(f"routed_experts must have 3 dimensions, got shape {array.shape}")
    dtype = array.dtype.newbyteorder("=") if array.dtype.byteorder not in ("=", "|", "<") else array.dtype
    if np.dtype(dtype.str.replace(">", "<")) not in SUPPORTED_DTYPES:
        raise RoutedExpertsError(f"routed_experts has unsupported dtype {array.dtype}")
    return np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False))
