"""SGLang's routed-experts encoding: base64 of the raw int32 capture, no header and no shape.

`meta_info.routed_experts` is `base64(tensor.numpy().tobytes())` of an int32 tensor shaped
`(rows, num_hidden_layers, num_experts_per_tok)`, rows covering positions
`[routed_experts_start_len, prompt_tokens + completion_tokens - 1)` (docs/sglang-http-api.md §3.5).
The bytes carry no shape, so the rows come from the call's token counts and the top-k from the
replica's configuration (SGLang's HTTP surface does not report the model's `num_experts_per_tok`);
the layers are what is left. Decoded to the same domain array as vLLM's (`domain/routed_experts`).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from rollout_grpc.server.domain.routed_experts import RoutedExpertsError


def decode(encoded: str, rows: int, topk: int) -> np.ndarray:
    """Decode SGLang's raw little-endian int32 into a contiguous `(rows, layers, topk)` array."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutedExpertsError(f"routed_experts is not base64: {exc}") from exc
    if len(raw) % 4:
        raise RoutedExpertsError(f"routed_experts has {len(raw)} bytes, not a whole number of int32")
    flat = np.frombuffer(raw, dtype="<i4")
    if rows <= 0:
        if flat.size:
            raise RoutedExpertsError(f"routed_experts has {flat.size} values for no position")
        return np.zeros((0, 0, topk), dtype="<i4")
    per_row = topk * rows
    if topk <= 0 or flat.size % per_row:
        raise RoutedExpertsError(
            f"routed_experts has {flat.size} int32 values, not {rows} positions x layers x top-{topk}"
        )
    return np.ascontiguousarray(flat.reshape(rows, flat.size // per_row, topk))
