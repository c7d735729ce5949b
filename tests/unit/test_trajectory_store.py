"""The agent sessions' store contract (server/state/trajectories.py) on every implementation — the
in-process `MemoryTrajectories`, the supervisor's over its unix socket, `RedisTrajectories` on a
real redis-server — and the use case over it (rollout/sessions.py): only a generated turn records
a session, ownership and the caps are per caller, a collected id stays its owner's, turns append
only in order, an unreachable store is UNAVAILABLE naming it."""

from __future__ import annotations

import asyncio
import pickle
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from rollout_grpc.server.domain.errors import FailedPrecondition, PermissionDenied, ResourceExhausted
from rollout_grpc.server.domain.identity import ANONYMOUS, Caller, Role
from rollout_grpc.server.domain.model import Finish, RoutedExperts, Status, WeightSpan
from rollout_grpc.server.domain.trajectory import Turn
from rollout_grpc.server.rollout.sessions import Sessions, decode_turn, encode_turn
from rollout_grpc.server.state.api import BufferCaps, StoreUnavailable
from rollout_grpc.server.state.choose import trajectories_for
from rollout_grpc.server.state.memory import MemoryStore
from rollout_grpc.server.state.redis_store import RedisStore
from rollout_grpc.server.state.redis_trajectories import RedisTrajectories
from rollout_grpc.server.state.socket import SocketTrajectories, serve_store
from rollout_grpc.server.state.trajectories import (
    RECORDED,
    REFUSED_BYTES,
    REFUSED_CONFLICT,
    REFUSED_OWNER,
    REFUSED_SESSIONS,
    MemoryTrajectories,
    TrajectoryCaps,
    TrajectoryStore,
)
from tests.support.processes import Processes
from tests.support.redis_server import RedisServer, redis_binary, start_redis

REDIS = redis_binary()
BOB = Caller(identity="bob", role=Role.TRAINER)
ALICE = Caller(identity="alice", role=Role.TRAINER)
ADMIN = Caller(identity="root", role=Role.ADMIN)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    with Processes(tmp_path_factory.mktemp("redis")) as procs:
        yield start_redis(procs, REDIS, random.Random())


Factory = Callable[[TrajectoryCaps], Awaitable[TrajectoryStore]]


@pytest.fixture(params=["memory", "socket", "redis"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Factory]:
    """Fresh, empty stores of one kind with the given caps."""
    kind = request.param
    opened: list[TrajectoryStore] = []
    servers: list[asyncio.Server] = []
    server: RedisServer | None = None
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        flusher = RedisTrajectories(server.url)
        await flusher._client.flushdb()
        await flusher.close()

    async def make(caps: TrajectoryCaps) -> TrajectoryStore:
        store: TrajectoryStore
        if kind == "memory":
            store = MemoryTrajectories(caps)
        elif kind == "socket":
            path = str(tmp_path / f"state-{len(servers)}.sock")
            servers.append(await serve_store(path, "s3cret", MemoryStore(), MemoryTrajectories(caps)))
            store = SocketTrajectories(path, "s3cret", caps)
        else:
            assert server is not None
            store = RedisTrajectories(server.url, caps)
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()
    for srv in servers:
        srv.close()


def turn(request_id: str = "r", size: int = 1) -> Turn:
    return Turn(request_id, [1] * size, [2], [-0.1], [], Finish.LENGTH, Status.TRUNCATED, "x")


async def generated(sessions: Sessions, session_id: str, owner: str, request_id: str = "r") -> None:
    """One request of `owner` on `session_id` whose turn generated."""
    async with sessions.opened(session_id, owner) as session:
        await sessions.record(session, turn(request_id), ["user", "assistant"])


async def test_turns_append_in_order_only_for_the_owner(make_store: Factory) -> None:
    store = await make_store(TrajectoryCaps())
    assert await store.read_session("s") is None
    assert await store.append_turn("bob", "s", 0, b"t0", b"user") == RECORDED
    assert await store.append_turn("bob", "s", 0, b"again", b"user") == REFUSED_CONFLICT
    assert await store.append_turn("alice", "s", 1, b"t1", b"user") == REFUSED_OWNER
    assert await store.append_turn("bob", "s", 1, b"t1", b"user\nassistant") == RECORDED
    found = await store.read_session("s")
    assert found is not None
    assert (found.owner, found.turns, found.roles) == ("bob", [b"t0", b"t1"], b"user\nassistant")
    assert await store.usage("bob") == (1, 2 + 2 + len(b"user\nassistant"))


async def test_the_session_cap_is_per_owner_and_refuses_naming_itself(make_store: Factory) -> None:
    store = await make_store(TrajectoryCaps(max_sessions_per_owner=2))
    for sid in ("a", "b"):
        assert await store.append_turn("bob", sid, 0, b"t", b"") == RECORDED
    assert await store.append_turn("bob", "c", 0, b"t", b"") == REFUSED_SESSIONS
    assert await store.append_turn("bob", "a", 1, b"t", b"") == RECORDED  # a live session continues
    assert await store.append_turn("alice", "c", 0, b"t", b"") == RECORDED  # alice has her own cap
    sessions = Sessions(store)
    with pytest.raises(ResourceExhausted, match="max_sessions_per_owner: this caller holds its 2 sessions"):
        async with sessions.opened("d", "bob"):
            pass


async def test_the_byte_cap_is_per_owner(make_store: Factory) -> None:
    store = await make_store(TrajectoryCaps(max_bytes_per_owner=10))
    assert await store.append_turn("bob", "a", 0, b"x" * 8, b"") == RECORDED
    assert await store.append_turn("bob", "a", 1, b"x" * 3, b"") == REFUSED_BYTES
    assert await store.append_turn("alice", "b", 0, b"x" * 10, b"") == RECORDED
    assert await store.remove_session("bob", "a", 1)
    assert await store.usage("bob") == (0, 0)
    assert await store.append_turn("bob", "c", 0, b"x" * 10, b"") == RECORDED


async def test_a_collected_id_stays_its_owners(make_store: Factory) -> None:
    store = await make_store(TrajectoryCaps(max_sessions_per_owner=1))
    assert await store.append_turn("bob", "s", 0, b"t", b"") == RECORDED
    await store.remove_session("alice", "s", 1)  # not hers: left alone
    assert (await store.read_session("s")) is not None and (await store.usage("bob"))[0] == 1
    assert not await store.remove_session("bob", "s", 2)  # holds 1 turn, not the 2 read
    assert (await store.usage("bob"))[0] == 1
    assert await store.remove_session("bob", "s", 1)
    found = await store.read_session("s")
    assert found is not None and found.owner == "bob" and found.turns == []
    assert await store.append_turn("alice", "s", 0, b"t", b"") == REFUSED_OWNER
    assert await store.append_turn("bob", "s", 0, b"t", b"") == RECORDED  # its owner's again
    # Collected ids are remembered per owner, at most max_sessions_per_owner of them.
    assert await store.remove_session("bob", "s", 1)
    assert await store.append_turn("bob", "s2", 0, b"t", b"") == RECORDED
    assert await store.remove_session("bob", "s2", 1)
    assert await store.read_session("s") is None  # pushed out by bob's own newer one
    assert (await store.read_session("s2")) is not None


async def test_a_session_expires_after_its_ttl(make_store: Factory) -> None:
    store = await make_store(TrajectoryCaps(ttl_s=0.3, max_sessions_per_owner=1))
    assert await store.append_turn("bob", "s", 0, b"t", b"") == RECORDED
    deadline = asyncio.get_running_loop().time() + 10
    while await store.read_session("s") is not None:  # polled: the store's own clock decides
        assert asyncio.get_running_loop().time() < deadline, "the session never expired"
        await asyncio.sleep(0.05)
    assert await store.usage("bob") == (0, 0)
    assert await store.append_turn("alice", "s", 0, b"t", b"") == RECORDED


async def test_only_a_generated_turn_records_and_readers_are_scoped(make_store: Factory) -> None:
    sessions = Sessions(await make_store(TrajectoryCaps()))
    with pytest.raises(ValueError):
        async with sessions.opened("s", "bob"):
            raise ValueError("an invalid request")
    assert await sessions.store.read_session("s") is None  # no claim on the id
    await generated(sessions, "s", "alice")
    with pytest.raises(PermissionDenied, match="belongs to another caller"):
        async with sessions.opened("s", "bob"):
            pass
    assert await sessions.get("s", BOB) is None  # another caller's session reads as missing
    got = await sessions.get("s", ADMIN)
    assert got is not None and [t.request_id for t in got.turns] == ["r"]
    await generated(sessions, "s", "alice", "r2")
    got = await sessions.get("s", ALICE, remove=True)
    assert got is not None and [t.request_id for t in got.turns] == ["r", "r2"]
    assert await sessions.get("s", ALICE) is None
    # Anonymous callers (auth off) share one identity, as before.
    await generated(sessions, "anon", ANONYMOUS.identity)
    assert await sessions.get("anon", ANONYMOUS) is not None


async def test_a_turn_recorded_meanwhile_elsewhere_refuses_the_stale_one(make_store: Factory) -> None:
    store = await make_store(TrajectoryCaps())
    here, there = Sessions(store), Sessions(store)
    async with here.opened("s", "bob") as mine:
        await generated(there, "s", "bob", "elsewhere")
        with pytest.raises(FailedPrecondition, match="another turn of it was recorded meanwhile"):
            await here.record(mine, turn("stale"), ["user", "assistant"])
    got = await here.get("s", BOB)
    assert got is not None and [t.request_id for t in got.turns] == ["elsewhere"]


async def test_get_trajectory_does_not_wait_for_a_turn_running_elsewhere(make_store: Factory) -> None:
    """What docs/agentic.md "A turn still running" says of a turn running on another replica or worker:
    the answer holds the turns recorded so far; a collection (`remove`) then makes that turn's
    recording fail FAILED_PRECONDITION, and the harness's resend starts the session afresh under
    the same id (still its owner's)."""
    store = await make_store(TrajectoryCaps())
    here, there = Sessions(store), Sessions(store)  # two processes sharing the store
    await generated(there, "s", "bob", "first")
    async with there.opened("s", "bob") as running:  # turn 2 runs on `there`
        got = await asyncio.wait_for(here.get("s", BOB), 10)  # not held by `there`'s turn
        assert got is not None and [t.request_id for t in got.turns] == ["first"]
        collected = await asyncio.wait_for(here.get("s", BOB, remove=True), 10)
        assert collected is not None and [t.request_id for t in collected.turns] == ["first"]
        with pytest.raises(FailedPrecondition, match="another turn of it was recorded meanwhile"):
            await there.record(running, turn("second"), ["user", "assistant"])
    assert await here.get("s", BOB) is None
    await generated(there, "s", "bob", "second-resent")
    got = await here.get("s", BOB)
    assert got is not None and [t.request_id for t in got.turns] == ["second-resent"]


def test_a_turn_round_trips_and_a_foreign_pickle_is_refused() -> None:
    original = turn()
    original.weight_versions = [WeightSpan("v1", 0, 1)]
    original.routed_experts = RoutedExperts(np.arange(6, dtype=np.int32).reshape(1, 2, 3), 4)
    back = decode_turn(encode_turn(original))
    assert back.weight_versions == original.weight_versions and back.finish == Finish.LENGTH
    assert back.routed_experts is not None and back.routed_experts.array.tolist() == [[[0, 1, 2], [3, 4, 5]]]
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        decode_turn(pickle.dumps(print))


async def test_an_unreachable_store_is_unavailable_naming_it(tmp_path: Path) -> None:
    sessions = Sessions(SocketTrajectories(str(tmp_path / "gone.sock"), "s"))
    with pytest.raises(StoreUnavailable, match=r"the state store embedded \(the supervisor's, .*gone.sock\)"):
        async with sessions.opened("s", "bob"):
            pass
    redis_down = Sessions(RedisTrajectories("redis://127.0.0.1:1/0", timeout_s=1.0))
    with pytest.raises(StoreUnavailable, match=r"the state store redis://127.0.0.1:1/0 is unavailable"):
        await redis_down.get("s", BOB)
    await redis_down.store.close()


async def test_the_sessions_in_redis_share_the_step_buffers_connection_pool() -> None:
    """One pool a replica to its store: the sessions ride on the buffer store's Redis client, and
    closing the sessions leaves that client to the store (it closes it at shutdown)."""
    store = RedisStore("redis://127.0.0.1:1/0", BufferCaps())  # no connection is made before a call
    sessions = trajectories_for(store, TrajectoryCaps())
    assert isinstance(sessions, RedisTrajectories)
    assert sessions._client is store.client
    assert sessions.name == store.name
    await sessions.close()  # the store's client stays open: the store closes it
    await store.close()
    assert isinstance(trajectories_for(MemoryStore(BufferCaps()), TrajectoryCaps()), MemoryTrajectories)
