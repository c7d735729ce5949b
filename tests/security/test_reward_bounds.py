"""Attacks through a RolloutStep's reward (issue: hardening round 3, items 1, 4, 5, 7, 8).

Each row is something a caller (or the reward server a caller names) can send; the replica must
answer it as a per-sample reward failure (or a refusal naming the field) and keep serving everyone.

| attack | expected |
| --- | --- |
| MATH label `9^{9^{9^{9}}}`, answer `\\boxed{5}` | failure naming the time limit; health, Generate answer |
| a reply over the reply cap | failure naming the cap; reading stopped at the cap |
| a detail over the detail bound | the reward kept, the detail replaced by a note |
| 4xx with a large body | failure with a bounded excerpt of the body |
| the POST redirected (301-308) | failure naming the status; the other host sees nothing |
| the probe redirected | the step refused (FAILED_PRECONDITION) naming the status |
| an endless probe answer | the probe reads at most its cap and succeeds |
| `reward.timeout_s` NaN, inf, -inf, 0, -1 | INVALID_ARGUMENT naming `reward.timeout_s` |
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc.client import make_sample, pb
from rollout_grpc.server.app import SERVICE_NAME
from rollout_grpc.server.rewards import remote
from tests.harness import Harness, harness
from tests.support.service import PROMPT, field_violation
from tests.support.steps import run_step

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


def finished_group(label: str, answer: str = "\\boxed{5}", index: int = 0) -> pb.PromptGroup:
    """A group whose one sample is already COMPLETED: the step only scores it (no engine work)."""
    partial = pb.Sample(
        tokens=[*PROMPT, 7],
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-1.0],
        response=answer,
        status=pb.SAMPLE_STATUS_COMPLETED,
        prompt="What is it?",
    )
    return pb.PromptGroup(prompt=make_sample(PROMPT), group_index=index, label=label, partial=[partial])


async def _health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=60
        )
        return int(reply.status)


# ----------------------------------------------------------------------------- rule rewards


async def test_a_math_reward_that_never_ends_is_killed_while_the_replica_keeps_serving() -> None:
    """The issue's freeze: on the old code the comparison held Python's lock for minutes, and this
    test hung at its first health check (pytest's timeout ended it)."""
    async with harness("sim", rule_reward_timeout_s=15.0) as h:
        order: list[str] = []
        group: list[pb.GroupResult] = []
        scoring = asyncio.Event()

        async def step() -> None:
            async for event in h.client.rollout_step(
                [finished_group("9^{9^{9^{9}}}")],
                n_samples_per_prompt=1,
                reward={"kind": "REWARD_KIND_MATH", "on_failure": "REWARD_FAILURE_POLICY_KEEP_UNSCORED"},
                stream_samples=True,
                timeout=120,
            ):
                if event.WhichOneof("event") == "sample":
                    scoring.set()  # the sample ended: its reward is being computed now
                elif event.WhichOneof("event") == "group":
                    order.append("group ended")
                    group.append(event.group)

        task = asyncio.create_task(step())
        await scoring.wait()
        # While the reward computes (for up to 15 s), the replica answers health and Generate.
        assert await _health(h.server.port) == health_pb2.HealthCheckResponse.SERVING
        order.append("health answered")
        sample = await h.client.generate(make_sample(PROMPT), GREEDY, timeout=60)
        assert sample.response_length == 2
        order.append("generate answered")
        await task
        assert order == ["health answered", "generate answered", "group ended"]
        [result] = group
        failure = result.samples[0].reward_failure
        assert "time limit of 15 s" in failure and "--rule-reward-timeout-s" in failure
        assert result.outcome == pb.GROUP_OUTCOME_ACCEPTED  # KEEP_UNSCORED: kept without a reward
        assert h.server.rule_processes is not None and h.server.rule_processes.killed == 1


async def test_rule_reward_processes_start_lazily_and_stop_with_the_replica() -> None:
    async with harness("sim") as h:
        rules = h.server.rule_processes
        assert rules is not None and rules.started == 0  # no child before the first rule reward
        run = await run_step(
            h, [finished_group("5")], n_samples_per_prompt=1, reward={"kind": "REWARD_KIND_MATH"}
        )
        assert run.groups[0].samples[0].reward == 1.0
        assert rules.started == 1
        children = list(rules._all)
    assert rules.started == 0
    assert all(not c.process.is_alive() for c in children)


# ----------------------------------------------------------------------------- the caller's bounds


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 0.0, -1.0])
async def test_a_reward_timeout_that_is_not_a_positive_finite_number_is_refused(value: float) -> None:
    async with harness("sim") as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run_step(
                h,
                [finished_group("5")],
                n_samples_per_prompt=1,
                reward=pb.RewardSpec(kind=pb.REWARD_KIND_MATH, timeout_s=value),
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(err.value) == "reward.timeout_s"


# ----------------------------------------------------------------------------- a hostile reward server


class HostileRewardServer:
    """A reward server (on the allowlist) that answers as the test says, and a second host that
    records whatever reaches it (where a redirect would send the sample)."""

    def __init__(self) -> None:
        self.answer: Any = None  # a web.StreamResponse factory
        self.probe_answer: Any = None
        self.elsewhere: list[str] = []
        self.url = ""
        self.other_url = ""

    async def _post(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        result: web.StreamResponse = await self.answer(request)
        return result

    async def _get(self, request: web.Request) -> web.StreamResponse:
        if self.probe_answer is None:
            return web.Response(status=405, text="POST only")
        result: web.StreamResponse = await self.probe_answer(request)
        return result

    async def _other(self, request: web.Request) -> web.Response:
        self.elsewhere.append(await request.text())
        return web.json_response(1.0)


@asynccontextmanager
async def hostile_server() -> AsyncIterator[HostileRewardServer]:
    server = HostileRewardServer()
    app = web.Application()
    app.router.add_post("/rm", server._post)
    app.router.add_get("/rm", server._get)
    other = web.Application()
    other.router.add_route("*", "/steal", server._other)
    runners = [web.AppRunner(app), web.AppRunner(other)]
    ports = []
    for runner in runners:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    server.url = f"http://127.0.0.1:{ports[0]}/rm"
    server.other_url = f"http://127.0.0.1:{ports[1]}/steal"
    try:
        yield server
    finally:
        for runner in runners:
            await runner.cleanup()


async def _endless(request: web.Request, chunk: bytes = b" " * (1 << 16)) -> web.StreamResponse:
    """An answer that never ends (the replica must stop reading at its cap)."""
    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    await response.prepare(request)
    try:
        while True:
            await response.write(chunk)
    except (ConnectionResetError, RuntimeError):
        pass
    return response


async def _scored(h: Harness, rm: HostileRewardServer, **reward: Any) -> pb.Sample:
    run = await run_step(
        h,
        [finished_group("5")],
        n_samples_per_prompt=1,
        reward={
            "kind": "REWARD_KIND_REMOTE",
            "url": rm.url,
            "max_retries": 0,
            "on_failure": "REWARD_FAILURE_POLICY_KEEP_UNSCORED",
            **reward,
        },
    )
    [group] = run.groups
    return group.samples[0]


@asynccontextmanager
async def _pinned(rm: HostileRewardServer) -> AsyncIterator[Harness]:
    prefix = rm.url.rsplit("/", 1)[0]
    async with harness("sim", reward_urls=[prefix]) as h:
        yield h


async def test_a_reward_reply_over_the_cap_is_a_failure_naming_the_cap() -> None:
    async with hostile_server() as rm, _pinned(rm) as h:
        rm.answer = _endless
        sample = await _scored(h, rm)
        assert not sample.HasField("reward")
        assert f"over the {remote.MAX_REPLY_BYTES} byte cap" in sample.reward_failure

        too_long = b"1" + b" " * remote.MAX_REPLY_BYTES

        async def declared(request: web.Request) -> web.Response:
            return web.Response(body=too_long, content_type="application/json")

        rm.answer = declared
        sample = await _scored(h, rm)
        assert f"over the {remote.MAX_REPLY_BYTES} byte cap" in sample.reward_failure


async def test_a_reward_detail_and_a_4xx_body_are_bounded() -> None:
    async with hostile_server() as rm, _pinned(rm) as h:

        async def big_detail(request: web.Request) -> web.Response:
            return web.json_response({"reward": 0.5, "why": "x" * (remote.MAX_DETAIL_BYTES + 1)})

        rm.answer = big_detail
        sample = await _scored(h, rm)
        assert sample.reward == 0.5
        detail = dict(sample.reward_detail)
        assert set(detail) == {"reward", "detail_omitted"}
        assert f"over the {remote.MAX_DETAIL_BYTES} byte bound" in str(detail["detail_omitted"])

        async def small_detail(request: web.Request) -> web.Response:
            return web.json_response({"reward": 0.25, "why": "fine"})

        rm.answer = small_detail
        sample = await _scored(h, rm)
        assert dict(sample.reward_detail) == {"reward": 0.25, "why": "fine"}

        async def refused(request: web.Request) -> web.Response:
            return web.Response(status=400, text="secret-" + "y" * 100_000)

        rm.answer = refused
        sample = await _scored(h, rm)
        assert "HTTP 400" in sample.reward_failure and "secret-" in sample.reward_failure
        assert len(sample.reward_failure) <= remote.MAX_FAILURE_CHARS


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_is_not_followed(status: int) -> None:
    async with hostile_server() as rm, _pinned(rm) as h:

        async def redirect(request: web.Request) -> web.Response:
            return web.Response(status=status, headers={"Location": rm.other_url})

        rm.answer = redirect
        sample = await _scored(h, rm)
        assert not sample.HasField("reward")
        assert f"HTTP {status}" in sample.reward_failure and "not followed" in sample.reward_failure
        rm.probe_answer = redirect
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _scored(h, rm)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"HTTP {status}" in (err.value.details() or "") and "not followed" in (
            err.value.details() or ""
        )
        assert rm.elsewhere == []  # the sample never left the allowlist


async def test_an_endless_probe_answer_is_read_up_to_its_cap() -> None:
    async with hostile_server() as rm, _pinned(rm) as h:
        rm.probe_answer = _endless

        async def score(request: web.Request) -> web.Response:
            return web.json_response(1.0)

        rm.answer = score
        sample = await _scored(h, rm)
        assert sample.reward == 1.0
