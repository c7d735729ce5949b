"""The state store's contract (server/state/api.py), run on every implementation: the in-process
`MemoryStore`, the supervisor's store over its unix socket (`SocketStore`), and `RedisStore` on a
real redis-server started for the module."""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain.model import RoutedExperts, Sample
from rollout_grpc.server.rollout.step.buffer import StepBuffers, decode_group, encode_group
from rollout_grpc.server.rollout.step.spec import PromptGroup, StepSample
from rollout_grpc.server.state.api import BufferCaps, BufferStore, StoredGroup, StoreUnavailable
from rollout_grpc.server.state.memory import MemoryStore
from rollout_grpc.server.state.redis_store import PREFIX, RedisStore, check_url
from rollout_grpc.server.state.socket import SocketStore, serve_store
from tests.support.processes import Processes, free_ports
from tests.support.redis_server import RedisServer, redis_binary, start_redis

REDIS = redis_binary()
KINDS = ["memory", "socket", "redis"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    with Processes(tmp_path_factory.mktemp("redis")) as procs:
        yield start_redis(procs, REDIS, random.Random())


StoreFactory = Callable[[BufferCaps], Awaitable[BufferStore]]


@pytest.fixture(params=KINDS)
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreFactory]:
    """A factory of fresh, empty stores of one kind with the given caps."""
    kind = request.param
    opened: list[BufferStore] = []
    servers: list[asyncio.Server] = []
    server: RedisServer | None = None
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        flusher = RedisStore(server.url)
        await flusher._client.flushdb()
        await flusher.close()

    async def make(caps: BufferCaps) -> BufferStore:
        store: BufferStore
        if kind == "memory":
            store = MemoryStore(caps)
        elif kind == "socket":
            # The supervisor's side (its MemoryStore on a unix socket) and a worker's client.
            path = str(tmp_path / f"state-{len(servers)}.sock")
            servers.append(await serve_store(path, "s3cret", MemoryStore(caps)))
            store = SocketStore(path, "s3cret", caps)
        else:
            assert server is not None
            store = RedisStore(server.url, caps)
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()
    for srv in servers:
        srv.close()


def g(index: int, size: int = 10) -> StoredGroup:
    return StoredGroup(index, size, f"blob-{index}".encode())


async def test_put_keeps_order_and_refuses_from_the_first_group_over_a_cap(make_store: StoreFactory) -> None:
    store = await make_store(
        BufferCaps(max_groups_per_owner=3, max_bytes_per_owner=100, max_bytes_total=1000)
    )
    assert await store.put("a", [g(1), g(2)]) == []
    # The third fits, the fourth is over the group cap, the fifth would fit but follows a refusal.
    assert await store.put("a", [g(3), g(4), g(5, 1)]) == [1, 2]
    held = await store.holding("a")
    assert (held.count, held.bytes, held.indexes) == (3, 30, frozenset({1, 2, 3}))
    assert await store.take("a") == [b"blob-1", b"blob-2", b"blob-3"]
    assert (await store.holding("a")).count == 0
    assert await store.total_bytes() == 0


async def test_byte_caps_per_owner_and_in_all(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps(max_bytes_per_owner=50, max_bytes_total=80))
    assert await store.put("a", [g(1, 40), g(2, 20)]) == [1]
    assert await store.put("b", [g(1, 40), g(2, 10)]) == [1]  # 40 + 40 <= 80 in all, 90 is over
    assert await store.total_bytes() == 80
    assert (await store.holding("b")).indexes == frozenset({1})


async def test_owners_never_see_each_others_groups(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps())
    await store.put("anonymous#alice", [g(1)])
    await store.put("anonymous#bob", [g(2)])
    assert await store.take("anonymous#bob") == [b"blob-2"]
    assert (await store.holding("anonymous#alice")).indexes == frozenset({1})
    assert await store.take_lost("anonymous#bob") == []


async def test_an_expired_buffer_is_reported_lost_not_dropped(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps(ttl_s=0.0))  # expires as it is written
    await store.put("a", [g(7), g(8)])
    assert (await store.holding("a")).count == 0
    assert await store.total_bytes() == 0
    assert sorted(await store.take_lost("a")) == [7, 8]
    assert await store.take_lost("a") == []


async def test_lost_indexes_are_kept_until_taken(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps())
    await store.note_lost("a", [3, 4])
    await store.note_lost("a", [5])
    assert await store.take_lost("a") == [3, 4, 5]


async def test_drain_leases_hold_a_continue_until_released_or_expired(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps(lease_ttl_s=600))
    assert await store.wait_drains("a", 0.0)
    await store.begin_drain("a", "L1")
    await store.renew_drain("a", "L1")
    assert not await store.wait_drains("a", 0.0)
    assert await store.wait_drains("b", 0.0)  # per owner
    await store.end_drain("a", "L1")
    assert await store.wait_drains("a", 0.0)
    expiring = await make_store(BufferCaps(lease_ttl_s=0.0))  # a killed holder's lease: already expired
    await expiring.begin_drain("c", "L2")
    assert await expiring.wait_drains("c", 5.0)


async def test_renewing_an_ended_lease_does_not_revive_it(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps(lease_ttl_s=600))
    await store.begin_drain("a", "L1")
    assert await store.renew_drain("a", "L1")
    await store.end_drain("a", "L1")
    assert not await store.renew_drain("a", "L1")
    assert await store.wait_drains("a", 0.0)


async def test_renewing_an_expired_lease_says_so_and_does_not_revive_it(make_store: StoreFactory) -> None:
    """A live replica that lost the store for longer than the lease: its renewal learns that the
    lease is gone (its held groups are reported lost), and the lease stays gone."""
    store = await make_store(BufferCaps(lease_ttl_s=0.3))
    await store.begin_drain("a", "cut-off")
    await store.hold_groups("a", "cut-off", [4])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while await store.renew_drain("a", "cut-off"):  # the expiry is the event waited for (bounded)
        assert loop.time() < deadline, "the lease never expired"
        await asyncio.sleep(0.4)  # longer than the TTL: renewals stop reaching it in time
    assert not await store.renew_drain("a", "cut-off")
    assert await store.wait_drains("a", 0.0)
    assert await store.take_lost("a") == [4]


async def test_a_lease_that_expires_unended_reports_its_held_groups_lost(make_store: StoreFactory) -> None:
    """A replica killed mid-step: the groups its step held only in its process are not silently
    gone; those it had buffered before it died are not lost (the buffer has them)."""
    store = await make_store(BufferCaps(lease_ttl_s=0.3))
    await store.begin_drain("a", "dead")
    await store.hold_groups("a", "dead", [1, 2, 3])
    await store.hold_groups("a", "dead", [1, 2, 3, 4])  # replaces: group 4 started
    assert await store.put("a", [g(2)]) == []  # group 2 buffered just before the kill
    assert await store.take_lost("a") == []  # still live: nothing lost yet
    assert await store.wait_drains("a", 10.0)  # it expires
    assert sorted(await store.take_lost("a")) == [1, 3, 4]
    assert await store.take_lost("a") == []  # reported once
    assert (await store.holding("a")).indexes == {2}


async def test_an_ended_lease_reports_nothing_and_a_dead_one_holds_nothing(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps(lease_ttl_s=0.3))
    await store.begin_drain("a", "done")
    await store.hold_groups("a", "done", [1, 2])
    await store.end_drain("a", "done")
    await store.hold_groups("a", "done", [5])  # a late write of an ended lease names nothing
    await store.hold_groups("a", "never", [6])  # nor one of a lease never begun
    await store.begin_drain("a", "emptied")
    await store.hold_groups("a", "emptied", [7])
    await store.hold_groups("a", "emptied", [])  # its groups were all delivered
    await store.begin_drain("b", "other")
    await store.hold_groups("b", "other", [8])
    assert await store.wait_drains("a", 10.0)
    assert await store.take_lost("a") == []
    assert await store.wait_drains("b", 10.0)
    assert await store.take_lost("b") == [8]  # per owner


async def test_take_held_takes_the_buffer_and_names_its_groups_held_in_one_operation(
    make_store: StoreFactory,
) -> None:
    """A continue step killed right after taking its buffered groups: they are reported lost, not
    silently gone (no instant between the take and the hold)."""
    store = await make_store(BufferCaps(lease_ttl_s=0.3))
    await store.put("a", [g(1), g(2)])
    assert await store.take_held("a", "never") == []  # a lease not live takes nothing
    assert (await store.holding("a")).indexes == {1, 2}
    await store.begin_drain("a", "dead")
    await store.hold_groups("a", "dead", [5])  # a group it has in flight already
    assert await store.take_held("a", "dead") == [b"blob-1", b"blob-2"]
    assert (await store.holding("a")).count == 0 and await store.total_bytes() == 0
    assert await store.take_held("a", "dead") == []  # the buffer is empty now
    assert await store.take_lost("a") == []  # still live: nothing lost yet
    assert await store.wait_drains("a", 10.0)  # killed before any other write: its lease expires
    assert sorted(await store.take_lost("a")) == [1, 2, 5]


# ------------------------------------------------------------------------------ the group codec


def _group() -> PromptGroup:
    sample = Sample(prompt_ids=(1,), response_ids=[2, 3], response_length=2, rollout_log_probs=[-0.5, -0.25])
    sample.routed_experts = RoutedExperts(np.arange(12, dtype=np.int32).reshape(2, 3, 2), start=1)
    origin = pb.Sample(tokens=[1, 2, 3])
    return PromptGroup(4, Sample(prompt_ids=(1,)), origin, 2, "lbl", [StepSample(sample, 0, origin=origin)])


def test_a_group_round_trips_with_its_r3_array_and_transport_origin() -> None:
    group = decode_group(encode_group(_group()))
    assert group.group_index == 4 and group.label == "lbl" and group.prompt.token_ids() == (1,)
    sample = group.partial[0].sample
    assert sample.token_ids() == (1, 2, 3) and sample.rollout_log_probs == [-0.5, -0.25]
    assert sample.routed_experts is not None and sample.routed_experts.array.shape == (2, 3, 2)
    assert group.origin == pb.Sample(tokens=[1, 2, 3])


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def test_a_blob_naming_anything_but_the_steps_types_is_refused() -> None:
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        decode_group(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="decoded to"):
        decode_group(pickle.dumps([1, 2]))


async def test_step_buffers_hand_back_what_does_not_fit(make_store: StoreFactory) -> None:
    buffers = StepBuffers(await make_store(BufferCaps(max_groups_per_owner=1)))
    first, second = _group(), _group()
    second.group_index = 5
    assert await buffers.put("a", [first, second]) == [second]
    assert "1 groups" in await buffers.full_reason("a")
    taken = await buffers.take("a")
    assert [t.group_index for t in taken] == [4]


# ------------------------------------------------------------------------------ redis specifics


def test_a_password_in_the_url_is_refused_naming_the_file_flag() -> None:
    with pytest.raises(ValueError, match="--state-store-password-file"):
        check_url("redis://:hunter2@localhost:6379/0")
    with pytest.raises(ValueError, match="neither redis"):
        check_url("http://localhost:6379")


async def test_an_unreachable_redis_fails_unavailable_naming_it() -> None:
    (port,) = free_ports(1)
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=2.0)
    with pytest.raises(StoreUnavailable, match=re.escape(f"redis://127.0.0.1:{port}/0")):
        await store.ping()
    with pytest.raises(StoreUnavailable, match="the state store"):
        await store.put("a", [g(1)])
    await store.close()


async def test_redis_keys_carry_the_prefix(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url)
    await store.put("owner-x", [g(1)])
    keys = {k.decode() if isinstance(k, bytes) else k for k in await store._client.keys("*owner-x*")}
    assert keys and all(k.startswith(PREFIX) for k in keys)
    await store.take("owner-x")
    await store.close()


async def test_redis_with_a_password_from_a_file(tmp_path: Path) -> None:
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    with Processes(tmp_path) as procs:
        server = start_redis(procs, REDIS, random.Random(), name="redis-auth", password="pw-from-file")
        secret = tmp_path / "redis-password"
        secret.write_text("pw-from-file\n")
        store = RedisStore(server.url, password_file=str(secret))
        await store.ping()
        await store.close()
        anonymous = RedisStore(server.url)
        with pytest.raises(StoreUnavailable, match=r"Authentication|NOAUTH|auth"):
            await anonymous.put("a", [g(1)])
        await anonymous.close()


# ----------------------------------------------------------------------------- fleet leases, versions


async def test_a_fleet_lease_has_one_holder_and_names_it(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps())
    assert await store.take_lease("weights", "replica-a", 30.0) == ""
    assert await store.take_lease("weights", "replica-a", 30.0) == ""  # its holder may take it again
    assert await store.take_lease("weights", "replica-b", 30.0) == "replica-a"
    assert await store.take_lease("other", "replica-b", 30.0) == ""  # per name
    assert not await store.renew_lease("weights", "replica-b", 30.0)  # not b's to renew
    await store.release_lease("weights", "replica-b")  # nor to release
    assert await store.take_lease("weights", "replica-b", 30.0) == "replica-a"
    assert await store.renew_lease("weights", "replica-a", 30.0)
    await store.release_lease("weights", "replica-a")
    assert await store.take_lease("weights", "replica-b", 30.0) == ""


async def test_a_fleet_lease_expires_unless_renewed(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps())
    assert await store.take_lease("weights", "dead", 0.05) == ""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    # The expiry is the event waited for (bounded): no fixed sleep decides the outcome.
    while (holder := await store.take_lease("weights", "alive", 30.0)) == "dead":
        assert loop.time() < deadline, "the lease of a holder that stopped renewing never expired"
        await asyncio.sleep(0.01)
    assert holder == ""
    assert not await store.renew_lease("weights", "dead", 30.0)  # an expired lease is not revived
    assert await store.take_lease("weights", "dead", 30.0) == "alive"


async def test_the_version_order_never_goes_backwards(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps())
    assert await store.version_order() == []
    assert await store.advance_version("v1") == (True, ["v1"])
    assert await store.advance_version("v2") == (True, ["v1", "v2"])
    assert await store.advance_version("v2") == (True, ["v1", "v2"])  # the newest again: no change
    assert await store.advance_version("v1") == (False, ["v1", "v2"])  # an older label
    assert await store.advance_version("7") == (True, ["v1", "v2", "7"])
    assert await store.advance_version("12") == (True, ["v1", "v2", "7", "12"])
    assert await store.advance_version("9") == (False, ["v1", "v2", "7", "12"])  # decimal, below
    assert await store.advance_version("012") == (False, ["v1", "v2", "7", "12"])  # equal as numbers
    assert await store.advance_version("100") == (True, ["v1", "v2", "7", "12", "100"])
    assert await store.version_order() == ["v1", "v2", "7", "12", "100"]
    other = await make_store(BufferCaps())  # another client of the same redis-server
    if isinstance(other, RedisStore):
        assert await other.version_order() == ["v1", "v2", "7", "12", "100"]


async def test_the_pause_epoch_grows_by_one_per_bump_for_every_client(make_store: StoreFactory) -> None:
    store = await make_store(BufferCaps())
    assert await store.pause_epoch() == 0
    assert await store.bump_pause_epoch() == 1
    assert await store.bump_pause_epoch() == 2
    assert await store.pause_epoch() == 2
    other = await make_store(BufferCaps())  # another client of the same redis-server
    if isinstance(other, RedisStore):
        assert await other.bump_pause_epoch() == 3
        assert await store.pause_epoch() == 3
