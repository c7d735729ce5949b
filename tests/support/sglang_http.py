"""Helpers for the SGLang personality's tests: an engine factory and the ``/generate`` calls.

Streams are read with ``parse_sse`` (SGLang frames events as ``data: <orjson>\\n\\n`` and ends
with ``data: [DONE]\\n\\n``, the same framing ``conformance.parse_sse`` checks).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt

from rollout_grpc.sim import SimConfig, SimEngine
from rollout_grpc.sim.config import SGLangOptions
from tests.support.sim_http import PROMPT, Reply, post


@contextlib.asynccontextmanager
async def sglang_engine(sglang: SGLangOptions | None = None, **config: Any) -> AsyncIterator[SimEngine]:
    """``async with sglang_engine(eos_probability=0.0) as eng:`` — an SGLang engine on loopback."""
    cfg = SimConfig(kind="sglang", sglang=sglang or SGLangOptions(), **config)
    async with SimEngine(cfg) as eng:
        yield eng


def body(rid: str | None = None, max_new_tokens: int | None = 8, **kw: Any) -> dict[str, Any]:
    """A greedy ``/generate`` body on the 20-token prompt with logprobs; ``kw`` are top-level keys,
    ``sp`` (a dict) is merged into ``sampling_params``."""
    sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **kw.pop("sp", {})}
    out: dict[str, Any] = {"input_ids": list(PROMPT), "sampling_params": sp, "return_logprob": True, **kw}
    if rid is not None:
        out["rid"] = rid
    return out


async def generate(session: aiohttp.ClientSession, base: str, payload: Any) -> Reply:
    return await post(session, base + "/generate", payload)


def decode_routed(b64: str, layers: int, topk: int) -> npt.NDArray[np.int32]:
    """A client's decoding: raw little-endian int32, reshaped to ``(rows, layers, topk)``."""
    flat = np.frombuffer(base64.b64decode(b64, validate=True), dtype="<i4")
    return flat.reshape(-1, layers, topk)
