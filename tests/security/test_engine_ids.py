"""Engine request ids are unique per replica and owner: the same caller-chosen id from two callers,
on two replicas over one shared engine, never names the same engine call, and Generate discloses
nothing about another caller's ids (hardening issue, "engine request ids").

Loopback, real replicas over real gRPC, one simulated vLLM engine over real HTTP.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rollout_grpc.client import AsyncRolloutClient, pb
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.sim import SimEngine
from tests.harness import running_server, sim_engines
from tests.security.credentials import ADMIN, PEER, TRAINER_A, TRAINER_B
from tests.support.service import LONG, SLOW_SIM, assert_lossless, field_violation, start_stream, started

TOKENS = 600
BOUNDED = {**LONG, "max_new_tokens": TOKENS}


@contextlib.asynccontextmanager
async def fleet(
    tokens: Path, tmp_path: Path
) -> AsyncIterator[tuple[SimEngine, RolloutServer, RolloutServer]]:
    """One slow engine shared by replicas A and B, each the other's authenticated peer."""
    peer_token = tmp_path / "peer-token"
    peer_token.write_text(PEER + "\n")
    secured: dict[str, object] = {"auth_tokens_file": str(tokens), "peer_token_file": str(peer_token)}
    async with (
        sim_engines(1, **SLOW_SIM) as sims,
        running_server([sims[0].url], **secured) as a,
        running_server([sims[0].url], peers=[f"127.0.0.1:{a.port}"], **secured) as b,
    ):
        yield sims[0], a, b


def client(server: RolloutServer, token: str) -> AsyncRolloutClient:
    return AsyncRolloutClient(f"127.0.0.1:{server.port}", token=token)


async def test_own_abort_on_one_replica_leaves_the_same_id_of_another_caller_on_another(
    tokens_file: Path, tmp_path: Path
) -> None:
    async with (
        fleet(tokens_file, tmp_path) as (engine, replica_a, replica_b),
        client(replica_a, TRAINER_A) as alice,
        client(replica_b, TRAINER_B) as bob,
    ):
        alices = start_stream(alice, "shared-8", BOUNDED)
        bobs = start_stream(bob, "shared-8", BOUNDED)
        await started(alices, bobs)

        response = await alice.abort(request_ids=["shared-8"])
        assert response.aborted == 1 and not response.unknown_request_ids
        assert (await alices.task).status == pb.SAMPLE_STATUS_ABORTED

        survivor = await bobs.task
        assert survivor.status == pb.SAMPLE_STATUS_TRUNCATED, survivor.status
        assert survivor.response_length == TOKENS
        assert_lossless(bobs, survivor)

        seen = list(engine.core.stats.engine_request_ids)
        assert len(seen) == 2 and len(set(seen)) == 2, seen
        # Identities stay off the engine: what it sees of an owner is a keyed hash.
        assert not any("trainer-a" in i or "trainer-b" in i for i in seen), seen


async def test_generate_with_another_callers_in_flight_id_succeeds(tokens_file: Path) -> None:
    async with (
        sim_engines(1, **SLOW_SIM) as sims,
        running_server([sims[0].url], auth_tokens_file=str(tokens_file)) as server,
        client(server, TRAINER_A) as alice,
        client(server, TRAINER_B) as bob,
    ):
        bobs = start_stream(bob, "bob-7", BOUNDED)
        await started(bobs)
        # No existence oracle: alice's Generate with bob's id runs like any other.
        alices = start_stream(alice, "bob-7", {**BOUNDED, "max_new_tokens": 5})
        sample = await alices.task
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 5
        assert not bobs.task.done()

        # A caller's own id in flight is still refused, in words about its own generations only.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await start_stream(bob, "bob-7", BOUNDED).task
        assert field_violation(err.value) == "request_id"
        details = err.value.details() or ""
        assert "you already have a generation with request_id 'bob-7' in flight" in details, details

        # Alice's abort of that id reaches nothing of bob's.
        assert (await alice.abort(request_ids=["bob-7"])).aborted == 0
        survivor = await bobs.task
        assert survivor.status == pb.SAMPLE_STATUS_TRUNCATED and survivor.response_length == TOKENS


async def test_an_admins_abort_by_id_reaches_the_other_replica_through_the_peers(
    tokens_file: Path, tmp_path: Path
) -> None:
    """Engine ids of another replica cannot be guessed any more: an admin's unknown ids go to the
    peers (any owner there), not blindly to the engines."""
    async with (
        fleet(tokens_file, tmp_path) as (_engine, replica_a, replica_b),
        client(replica_a, TRAINER_A) as alice,
        client(replica_b, ADMIN) as admin,
    ):
        far = start_stream(alice, "far-1", BOUNDED)
        await started(far)
        response = await admin.abort(request_ids=["far-1"])
        assert response.aborted == 1 and not response.unknown_request_ids  # the peer knew it
        sample = await far.task
        assert sample.status == pb.SAMPLE_STATUS_ABORTED
        assert_lossless(far, sample)
