"""The replica's keep-alive pool for reward, filter and environment POSTs (rewards/connections.py):
steps reuse each other's connections, each step keeps its own session state, and the pool closes
with the replica. Real HTTP servers on loopback; a real gRPC replica for the step test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from rollout_grpc.client import make_sample, pb
from rollout_grpc.server.rewards.api import RewardConfig, RewardKind, RewardRequest, RewardResult
from rollout_grpc.server.rewards.connections import PostConnections
from rollout_grpc.server.rewards.remote import RemoteReward
from tests.harness import Harness, harness
from tests.support.reward_server import RewardServer
from tests.support.service import PROMPT
from tests.support.steps import run_step

SHORT = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": 3}


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with harness("sim") as running:
        yield running


async def test_a_second_step_reuses_the_first_steps_reward_connection(h: Harness) -> None:
    """One request at a time (max_concurrency 1): the first step opens one connection, for its
    probe and its POSTs; the second step finds it in the replica's pool and opens none. (A session
    per step opened a new one per step.)"""
    async with RewardServer() as rm:
        for step in range(2):
            run = await run_step(
                h,
                [pb.PromptGroup(prompt=make_sample(PROMPT, index=0), group_index=0, label="parity")],
                n_samples_per_prompt=3,
                params=SHORT,
                step_id=f"conn-{step}",
                reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url, "max_concurrency": 1},
            )
            assert run.summary is not None and run.summary.accepted == 1
            assert all(s.HasField("reward") for s in run.groups[0].samples)
        assert rm.probes == 2 and len(rm.requests) == 6
        assert rm.connections == 1, f"{rm.connections} connections for two steps"


def config(url: str) -> RewardConfig:
    return RewardConfig(kind=RewardKind.REMOTE, url=url, max_concurrency=1)


async def test_pooled_clients_share_connections_but_not_cookies() -> None:
    """A cookie one step's reward server sets stays with that step's session: the next step's
    requests over the same pooled connection carry none."""
    cookies: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        cookies.append(request.cookies.get("caller"))
        response = web.json_response(1.0)
        response.set_cookie("caller", "a")
        return response

    app = web.Application()
    app.router.add_post("/rm", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pool = PostConnections()
    request = RewardRequest(prompt="", response="x", label="")
    try:
        # localhost, not 127.0.0.1: aiohttp's cookie jar ignores cookies of IP-address hosts.
        first = RemoteReward(config(f"http://localhost:{port}/rm"), pool)
        assert await first.score(request) == RewardResult(1.0)
        assert await first.score(request) == RewardResult(1.0)
        await first.close()
        second = RemoteReward(config(f"http://localhost:{port}/rm"), pool)
        assert await second.score(request) == RewardResult(1.0)
        await second.close()
    finally:
        await pool.close()
        await runner.cleanup()
    assert cookies == [None, "a", None], "the first session keeps its cookie; the second starts clean"


async def test_closing_the_pool_closes_its_connections_and_a_later_step_opens_new_ones() -> None:
    async with RewardServer() as rm:
        pool = PostConnections()
        request = RewardRequest(prompt="", response="x", label="one")
        for _ in range(2):
            client = RemoteReward(config(rm.url), pool)
            assert await client.score(request) == RewardResult(1.0)
            await client.close()
        assert rm.connections == 1
        await pool.close()
        client = RemoteReward(config(rm.url), pool)
        assert await client.score(request) == RewardResult(1.0)
        await client.close()
        await pool.close()
        assert rm.connections == 2, "the closed pool's connection is gone; a new one was opened"
