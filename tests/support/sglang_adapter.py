"""The SGLang adapter over a simulated SGLang engine: one call's builders and readers, shared by
the adapter's tests (test_sglang_adapter.py) and the 0.5.23 behaviour tests (test_sglang_0523.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from rollout_grpc.server.domain.model import SamplingParams
from rollout_grpc.server.engines.api import EngineCall, EngineDelta, EngineEvent, EngineFinal
from rollout_grpc.server.engines.sglang.adapter import SglangEngine
from rollout_grpc.server.rollout.call_ids import CallIds
from rollout_grpc.sim import SimConfig, SimEngine
from rollout_grpc.sim.config import SGLangOptions

PROMPT = [11, 12, 13, 14, 15]
#: Call ids as the domain builds them (one replica, one owner).
IDS = CallIds.new()


def call_id(rid: str, attempt: int = 0) -> str:
    return IDS.call_id("alice", rid, attempt)


def call(rid: str = "r", attempt: int = 0, max_tokens: int | None = 8, **kw: Any) -> EngineCall:
    sampling = kw.pop("sampling", SamplingParams(temperature=0.0))
    return EngineCall(call_id(rid, attempt), attempt, list(PROMPT), sampling, max_tokens, 0, **kw)


@contextlib.asynccontextmanager
async def sglang(
    incremental: bool = False,
    topk: int | None = None,
    sglang_options: SGLangOptions | None = None,
    **config: Any,
) -> AsyncIterator[tuple[SimEngine, SglangEngine]]:
    config.setdefault("eos_probability", 0.0)
    options = sglang_options or SGLangOptions(incremental_streaming_output=incremental)
    cfg = SimConfig(kind="sglang", sglang=options, **config)
    async with SimEngine(cfg) as sim, aiohttp.ClientSession() as http:
        yield sim, SglangEngine(sim.url, http, experts_topk=topk)


async def collect(adapter: SglangEngine, c: EngineCall) -> list[EngineEvent]:
    return [event async for event in adapter.generate(c)]


def joined(events: list[EngineEvent]) -> tuple[list[int], list[float], str, EngineFinal]:
    deltas = [e for e in events if isinstance(e, EngineDelta)]
    finals = [e for e in events if isinstance(e, EngineFinal)]
    assert len(finals) == 1 and events[-1] is finals[0]
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    return tokens, logprobs, "".join(d.text for d in deltas), finals[0]
