"""Routed experts (R3) as vLLM's ``--enable-return-routed-experts`` delivers them (reference §6).

Rows cover token positions ``[routed_experts_prompt_start, prompt_len + n_out - 1)`` — the last
generated token has not been through a forward pass — and each row holds, per layer, the top-k
expert ids the router picked. The ids are a deterministic function of (absolute position, layer,
token at that position), so re-prefilling ``prompt + partial output`` in a continuation yields
identical rows for the shared positions, which is what routing replay relies on.
"""

from __future__ import annotations

import base64
import functools
import io
import math
from typing import Any

import numpy as np
import numpy.typing as npt


@functools.lru_cache(maxsize=16)
def _strides(num_experts: int) -> npt.NDArray[np.uint64]:
    """Strides coprime to ``num_experts``: ``a + j*s (mod E)`` is then distinct for j < E."""
    s = [k for k in range(1, max(2, num_experts)) if math.gcd(k, num_experts) == 1] or [1]
    return np.array(s, dtype=np.uint64)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def routed_experts(
    all_token_ids: list[int],
    start: int,
    end: int,
    *,
    num_layers: int,
    num_experts: int,
    topk: int,
    seed: int,
) -> npt.NDArray[np.unsignedinteger[Any]]:
    """Expert ids for positions ``start..end-1`` of ``all_token_ids``: shape [rows, layers, topk]."""
    rows = max(0, end - start)
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    if rows == 0:
        empty: npt.NDArray[np.unsignedinteger[Any]] = np.zeros((0, num_layers, topk), dtype=dtype)
        return empty
    pos = np.arange(start, end, dtype=np.uint64)
    tok = np.asarray(all_token_ids[start:end], dtype=np.uint64)
    layer = np.arange(num_layers, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = (
            (pos[:, None] * np.uint64(0x9E3779B97F4A7C15))
            ^ (tok[:, None] * np.uint64(0xC2B2AE3D27D4EB4F))
            ^ (layer[None, :] * np.uint64(0x165667B19E3779F9))
            ^ np.uint64(seed & 0xFFFFFFFF)
        )
        h = _mix(key)
    strides = _strides(num_experts)
    e = np.uint64(num_experts)
    a = h % e
    s = strides[(h >> np.uint64(32)) % np.uint64(len(strides))]
    j = np.arange(topk, dtype=np.uint64)
    with np.errstate(over="ignore"):
        ids = (a[:, :, None] + j[None, None, :] * s[:, :, None]) % e
    out: npt.NDArray[np.unsignedinteger[Any]] = ids.astype(dtype)
    return out


def encode_npy_b64(arr: npt.NDArray[np.generic]) -> str:
    """``vllm/utils/serial_utils.py::numpy2base64``: ``np.save`` then base64."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_npy_b64(s: str) -> npt.NDArray[np.generic]:
    """The client side of the encoding (tests and tools)."""
    out: npt.NDArray[np.generic] = np.load(io.BytesIO(base64.b64decode(s, validate=True)), allow_pickle=False)
    return out
