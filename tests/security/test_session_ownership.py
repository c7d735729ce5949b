"""Front-door sessions cannot be taken over (hardening issue, "sessions"): failing requests create
no session, the session cap is per owner (a session beyond it is refused, nothing is evicted), and
a session id stays its owner's after collection. The attack: failing turns from alice evicted bob's
trajectory, alice then claimed bob's session id and bob's next turn got 403.

Loopback: a replica with the front door over one simulated engine, the official `openai` client
over real HTTP, trajectories read over real gRPC.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from rollout_grpc.client import AsyncRolloutClient
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.server.config import FrontDoorConfig
from tests.harness import running_server, sim_engines
from tests.security.credentials import TRAINER_A, TRAINER_B

pytestmark = pytest.mark.timeout(120)

HELLO: list[dict[str, Any]] = [{"role": "user", "content": "Hello there"}]
SHORT: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4}


@contextlib.asynccontextmanager
async def front_door(tokens: Path, max_sessions: int) -> AsyncIterator[RolloutServer]:
    """A replica with authentication and the front door, keeping `max_sessions` sessions."""
    async with (
        sim_engines(1) as sims,
        running_server(
            [sims[0].url],
            openai_port=0,
            openai=FrontDoorConfig(max_sessions=max_sessions),
            auth_tokens_file=str(tokens),
        ) as server,
    ):
        yield server


async def turn(server: RolloutServer, token: str, session: str, **extra: Any) -> Any:
    """One chat completion of `session` with the official client presenting `token`."""
    base = f"http://127.0.0.1:{server.openai_port}/sessions/{session}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key=token, max_retries=0) as client:
        completions: Any = client.chat.completions
        return await completions.create(**{"model": "", "messages": HELLO, **SHORT, **extra})


async def turns_recorded(server: RolloutServer, token: str, session: str) -> int:
    """How many turns `session` has for the caller of `token` (0: NOT_FOUND)."""
    async with AsyncRolloutClient(f"127.0.0.1:{server.port}", token=token, retry=None) as client:
        try:
            return len((await client.get_trajectory(session)).turns)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND, err
            return 0


async def test_failing_turns_create_no_session_evict_nothing_and_claim_nothing(tokens_file: Path) -> None:
    async with front_door(tokens_file, max_sessions=4) as server:
        await turn(server, TRAINER_B, "bob-sess")
        for i in range(6):  # more failing turns than the cap: each fails before generating
            with pytest.raises(openai.NotFoundError):
                await turn(server, TRAINER_A, f"alice-{i}", model="no-such-model")
            assert await turns_recorded(server, TRAINER_A, f"alice-{i}") == 0
        assert await turns_recorded(server, TRAINER_B, "bob-sess") == 1

        with pytest.raises(openai.PermissionDeniedError):
            await turn(server, TRAINER_A, "bob-sess")
        await turn(server, TRAINER_B, "bob-sess")
        assert await turns_recorded(server, TRAINER_B, "bob-sess") == 2

        # A failed first turn did not claim its id either: another caller may still use it.
        await turn(server, TRAINER_B, "alice-0")
        assert await turns_recorded(server, TRAINER_B, "alice-0") == 1


async def test_one_owners_sessions_never_evict_anothers(tokens_file: Path) -> None:
    async with front_door(tokens_file, max_sessions=2) as server:
        await turn(server, TRAINER_B, "bob-sess")
        for i in range(2):
            await turn(server, TRAINER_A, f"alice-{i}")
        # The cap holds per owner: alice's third session is refused, naming the cap; nothing of
        # anyone's is evicted, and bob still has room of his own.
        with pytest.raises(openai.RateLimitError, match="max_sessions_per_owner"):
            await turn(server, TRAINER_A, "alice-2")
        assert await turns_recorded(server, TRAINER_B, "bob-sess") == 1
        assert await turns_recorded(server, TRAINER_A, "alice-0") == 1
        assert await turns_recorded(server, TRAINER_A, "alice-1") == 1
        assert await turns_recorded(server, TRAINER_A, "alice-2") == 0
        await turn(server, TRAINER_A, "alice-1")  # a live session continues at the cap
        await turn(server, TRAINER_B, "bob-2")


async def test_a_collected_session_id_stays_its_owners(tokens_file: Path) -> None:
    async with front_door(tokens_file, max_sessions=1) as server:
        await turn(server, TRAINER_B, "bob-old")
        # Collected with GetTrajectory(remove): the id is still bob's.
        async with AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_B, retry=None) as bob:
            assert len((await bob.get_trajectory("bob-old", remove=True)).turns) == 1
        assert await turns_recorded(server, TRAINER_B, "bob-old") == 0
        with pytest.raises(openai.PermissionDeniedError) as err:
            await turn(server, TRAINER_A, "bob-old")
        assert "another caller" in str(err.value)
        await turn(server, TRAINER_B, "bob-new")  # the collected session freed bob's cap
        await turn(server, TRAINER_B, "bob-new")
        assert await turns_recorded(server, TRAINER_B, "bob-new") == 2
