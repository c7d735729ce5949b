"""Agent sessions in the state store (issue 37): two `rollout-grpc serve` replicas sharing one real
redis-server, each with its OpenAI front door, over simulated engines, all real processes.

* a session's first turn on replica A and its next turn on replica B are one conversation: B
  continues the sample A recorded, and GetTrajectory on either returns both turns;
* identity scoping holds across replicas: another trainer neither reads the session on B nor adds
  a turn to it there;
* a replica restarted keeps the recorded turns (they are in Redis, not in its memory);
* with the store gone, a turn and GetTrajectory fail UNAVAILABLE naming the store.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from rollout_grpc.client import AsyncRolloutClient, NotFoundError
from tests.support.processes import Processes, Replica, start_replica
from tests.support.redis_server import redis_binary
from tests.support.store_fleet import StoreFleet, store_fleet
from tests.support.workers import client

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (.ci/run installs it)"),
]

ALICE = "token-of-alice"
BOB = "token-of-bob"
HELLO: list[dict[str, Any]] = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


def replica_args(tmp: Path) -> list[str]:
    """The front door on, two trainers' tokens."""
    tokens = tmp / "tokens"
    if not tokens.exists():
        tokens.write_text(f"alice trainer {ALICE}\nbob trainer {BOB}\n")
    return ["--openai-port", "0", "--auth-tokens-file", str(tokens)]


def fleet_of_two(procs: Processes) -> StoreFleet:
    return store_fleet(procs, replica_args=replica_args(procs.workdir))


async def chat(
    replica: Replica, token: str, session: str, messages: list[dict[str, Any]]
) -> tuple[int, dict[str, Any]]:
    """One non-streaming turn of `session` on `replica`'s front door: (HTTP status, body)."""
    url = f"http://127.0.0.1:{replica.info['openai']}/sessions/{session}/v1/chat/completions"
    body = {"model": "", "messages": messages, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http,
        http.post(url, json=body) as reply,
    ):
        return reply.status, await reply.json()


def followup(first: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation after the first turn's reply, with the next user message."""
    reply = first["choices"][0]["message"]["content"]
    return [*HELLO, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]


async def trajectory(replica: Replica, token: str, session: str) -> Any:
    async with client(replica.target, token) as on:
        return await on.get_trajectory(session)


async def test_a_session_continues_on_another_replica_and_reads_on_both(procs: Processes) -> None:
    fleet = fleet_of_two(procs)
    a, b = fleet.replicas
    status, first = await chat(a, ALICE, "shared", HELLO)
    assert status == 200, first
    status, second = await chat(b, ALICE, "shared", followup(first))
    assert status == 200, second
    for on in (a, b):
        got = await trajectory(on, ALICE, "shared")
        assert [len(t.response_token_ids) for t in got.turns] == [6, 6]
        # B continued A's sample: one sample, the second turn's prompt extends the first turn.
        assert [t.sample_index for t in got.turns] == [0, 0] and len(got.samples) == 1
        assert (
            list(got.turns[1].prompt_token_ids[: len(first["prompt_token_ids"])]) == first["prompt_token_ids"]
        )
        prompt = len(first["prompt_token_ids"])
        assert list(got.samples[0].tokens[prompt : prompt + 6]) == first["choices"][0]["token_ids"]

    # Bob reaches neither the trajectory nor the session, on the replica that did not record it.
    with pytest.raises(NotFoundError):
        await trajectory(b, BOB, "shared")
    status, refused = await chat(b, BOB, "shared", HELLO)
    assert status == 403 and "another caller" in refused["error"]["message"], refused
    assert len((await trajectory(a, ALICE, "shared")).turns) == 2


async def test_a_restarted_replica_keeps_the_recorded_turns(procs: Processes) -> None:
    fleet = fleet_of_two(procs)
    a = fleet.replicas[0]
    status, first = await chat(a, ALICE, "kept", HELLO)
    assert status == 200, first
    os.kill(a.proc.pid, signal.SIGKILL)  # nothing is flushed on the way out
    assert a.proc.popen.wait(timeout=30) == -signal.SIGKILL
    again = start_replica(
        procs,
        "replica-0-again",
        fleet.engines,
        ["--state-store", fleet.redis.url, *replica_args(procs.workdir)],
    )
    got = await trajectory(again, ALICE, "kept")
    assert list(got.turns[0].response_token_ids) == first["choices"][0]["token_ids"]
    status, second = await chat(again, ALICE, "kept", followup(first))
    assert status == 200, second
    got = await trajectory(again, ALICE, "kept")
    assert [t.sample_index for t in got.turns] == [0, 0]


async def test_without_the_store_a_turn_and_get_trajectory_are_unavailable_naming_it(
    procs: Processes,
) -> None:
    fleet = fleet_of_two(procs)
    a = fleet.replicas[0]
    status, first = await chat(a, ALICE, "down", HELLO)
    assert status == 200, first
    fleet.redis.proc.popen.kill()
    fleet.redis.proc.popen.wait(timeout=30)
    status, refused = await chat(a, ALICE, "down", followup(first))
    assert status == 503, refused
    assert f"the state store {fleet.redis.url} is unavailable" in refused["error"]["message"]
    async with AsyncRolloutClient(a.target, token=ALICE, retry=None) as on:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await on.get_trajectory("down")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"the state store {fleet.redis.url} is unavailable" in (err.value.details() or "")
