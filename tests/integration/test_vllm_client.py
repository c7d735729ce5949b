"""The engine HTTP client's own contracts, against a simulated engine over real HTTP."""

from __future__ import annotations

import asyncio

import aiohttp

from rollout_grpc.server.engines.api import EngineTimeouts
from rollout_grpc.server.engines.vllm.adapter import VllmEngine
from rollout_grpc.sim import SimConfig, SimEngine
from tests.support.service import PROMPT


async def test_pause_wait_is_not_cut_by_the_control_timeout() -> None:
    """`/pause?mode=wait` returns only once the engine drained: no control timeout applies."""
    async with SimEngine(SimConfig(token_delay_s=0.005)) as sim, aiohttp.ClientSession() as session:
        engine = VllmEngine(sim.url, session, EngineTimeouts(control=0.05))
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 100, "ignore_eos": True}}
        running = asyncio.create_task(session.post(sim.url + "/inference/v1/generate", json=body))
        await sim.wait_for_running(1)
        await engine.pause("wait", timeout=None)  # the generation takes ~10x the control timeout
        reply = await running
        result = await reply.json()
        assert result["choices"][0]["finish_reason"] == "length"
        assert len(result["choices"][0]["token_ids"]) == 100
        await engine.resume()
        assert not await engine.is_paused()
