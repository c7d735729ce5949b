"""Aborts across replicas that share one state store, with no `--peer` (issues 35 and 37): real
`rollout-grpc serve` processes on one simulated engine process and one real redis-server.

* an abort by session, group or request id sent to replica A ends the generation replica B serves,
  which keeps the tokens it generated (ABORTED, lossless); an id nobody holds is reported unknown;
* the same from a worker of a `--workers 2` replica: every worker of both replicas reached, and
  counted once (not once per path: the store and the sibling channel);
* Abort(all) on A counts B's generations too (the engines' pause ends them either way);
* a `--peer` list next to the store is not used (logged at start): an abort is counted once;
* the store down: the abort that needs it fails UNAVAILABLE naming the store, while a plain
  Generate keeps working and a generation of the replica itself is still aborted; the store back
  (same port), the replicas re-subscribe and the fleet's aborts reach B again.

Every wait is on an observed event (the first token of a stream, an abort's answer), bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_grpc.client import AsyncRolloutClient, UnavailableError, make_sample, pb
from tests.support.processes import Engine, Processes, Replica, start_engine, start_replica
from tests.support.redis_server import RedisServer, redis_binary, start_redis
from tests.support.service import PROMPT, Stream, assert_lossless, start_stream, started
from tests.support.workers import client, clients_by_worker
from tests.support.workers import start_replica as start_workers

REDIS = redis_binary()

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (.ci/run installs it)"),
]

#: Longest any awaited event may take on a loaded machine.
WAIT_S = 60.0
#: Streams that outlast every test step unless aborted (the engine's 5 ms a token: 25 s).
LONG: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 5000, "ignore_eos": True}
SHORT: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}


@dataclass
class Fleet:
    redis: RedisServer
    engine: Engine
    a: Replica
    b: Replica


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


@pytest.fixture
def fleet(procs: Processes) -> Fleet:
    assert REDIS is not None
    redis = start_redis(procs, REDIS, random.Random())
    engine = start_engine(procs, "engine", "--eos-probability", "0", token_delay_ms=5)
    args = ["--workers", "1", "--state-store", redis.url, "--control-deadline", "10"]
    a = start_replica(procs, "replica-a", [engine], args)
    b = start_replica(procs, "replica-b", [engine], args)
    return Fleet(redis, engine, a, b)


@contextlib.asynccontextmanager
async def _clients(*targets: str) -> AsyncIterator[list[AsyncRolloutClient]]:
    clients = [client(t) for t in targets]  # no client retries: an UNAVAILABLE is seen as is
    try:
        yield clients
    finally:
        for c in clients:
            await c.close()


def _sample(session: str = "", group: int = 0) -> pb.Sample:
    return make_sample(PROMPT, session_id=session, group_index=group)


async def _ended_aborted(stream: Stream) -> pb.Sample:
    """The stream's final sample: ABORTED, holding exactly the tokens it streamed (some)."""
    sample = await asyncio.wait_for(stream.task, WAIT_S)
    assert sample.status == pb.SAMPLE_STATUS_ABORTED, sample.status
    assert sample.response_length > 0
    assert_lossless(stream, sample)
    return sample


async def test_session_group_and_id_aborts_on_one_replica_end_the_other_replicas_generations(
    fleet: Fleet,
) -> None:
    async with _clients(fleet.a.target, fleet.b.target) as (on_a, on_b):
        by_session = start_stream(on_b, "b-session", LONG, _sample(session="sess-b", group=3))
        by_group = start_stream(on_b, "b-group", LONG, _sample(group=41))
        by_id = start_stream(on_b, "b-id", LONG, _sample(group=5))
        bystander = start_stream(on_b, "b-bystander", LONG, _sample(session="other", group=6))
        await asyncio.wait_for(started(by_session, by_group, by_id, bystander), WAIT_S)

        assert (await on_a.abort(session_id="sess-b")).aborted == 1
        await _ended_aborted(by_session)
        assert (await on_a.abort(group_index=41)).aborted == 1
        await _ended_aborted(by_group)
        response = await on_a.abort(request_ids=["b-id", "nobody-holds-this"])
        assert response.aborted == 1
        assert list(response.unknown_request_ids) == ["nobody-holds-this"]
        await _ended_aborted(by_id)

        # Nothing else was touched: the bystander still streams, and B aborts it itself.
        assert not bystander.task.done()
        assert (await on_b.abort(request_ids=["b-bystander"])).aborted == 1
        await _ended_aborted(bystander)


async def test_an_abort_of_mine_reaches_the_callers_generations_on_every_replica(fleet: Fleet) -> None:
    async with _clients(fleet.a.target, fleet.b.target) as (on_a, on_b):
        here = start_stream(on_a, "mine-a", LONG, _sample())
        there = start_stream(on_b, "mine-b", LONG, _sample())
        await asyncio.wait_for(started(here, there), WAIT_S)
        assert (await on_a.abort(mine=True)).aborted == 2
        await _ended_aborted(here)
        await _ended_aborted(there)


async def test_abort_all_counts_the_other_replicas_generations(fleet: Fleet) -> None:
    async with _clients(fleet.a.target, fleet.b.target) as (on_a, on_b):
        there = start_stream(on_b, "all-b", LONG, _sample())
        await asyncio.wait_for(started(there), WAIT_S)
        # The engines' pause ends B's stream whoever asks; the store lets A count it too.
        assert (await on_a.abort(all=True)).aborted == 1
        await _ended_aborted(there)


async def test_with_the_store_a_peer_list_is_not_used_and_the_abort_is_counted_once(
    procs: Processes,
) -> None:
    assert REDIS is not None
    redis = start_redis(procs, REDIS, random.Random())
    engine = start_engine(procs, "engine", "--eos-probability", "0", token_delay_ms=5)
    args = ["--workers", "1", "--state-store", redis.url]
    a = start_replica(procs, "replica-a", [engine], args)
    b = start_replica(procs, "replica-b", [engine], [*args, "--peer", a.target])
    [warning] = b.log_events("peers_not_used")
    assert warning["peers"] == [a.target] and redis.url in str(warning["reason"]), warning
    async with _clients(a.target, b.target) as (on_a, on_b):
        there = start_stream(on_a, "peer-a", LONG, _sample(session="sess-peer"))
        await asyncio.wait_for(started(there), WAIT_S)
        assert (await on_b.abort(session_id="sess-peer")).aborted == 1  # not once per path
        await _ended_aborted(there)


async def test_the_workers_of_a_replica_on_the_store_count_an_abort_once(
    procs: Processes, tmp_path: Path
) -> None:
    assert REDIS is not None
    redis = start_redis(procs, REDIS, random.Random())
    engine = start_engine(procs, "engine", "--eos-probability", "0", token_delay_ms=5)
    replica = start_workers(
        procs, tmp_path, "--engine", engine.url, "--workers", "2", "--state-store", redis.url
    )
    other = start_replica(procs, "replica-b", [engine], ["--workers", "1", "--state-store", redis.url])
    async with clients_by_worker(replica.target, 2) as by_worker, _clients(other.target) as (on_b,):
        on_1 = start_stream(by_worker[1], "w1-session", LONG, _sample(session="sess-w", group=8))
        on_0 = start_stream(by_worker[0], "w0-session", LONG, _sample(session="sess-w", group=9))
        on_other = start_stream(on_b, "b-session", LONG, _sample(session="sess-w", group=10))
        await asyncio.wait_for(started(on_1, on_0, on_other), WAIT_S)
        # Every worker of both replicas hears the store; the sibling channel does not carry it
        # again (which would count worker 1's generation twice).
        assert (await by_worker[0].abort(session_id="sess-w")).aborted == 3
        for stream in (on_1, on_0, on_other):
            await _ended_aborted(stream)


async def test_with_the_store_down_the_abort_that_needs_it_fails_unavailable_and_generate_works(
    fleet: Fleet, procs: Processes
) -> None:
    async with _clients(fleet.a.target, fleet.b.target) as (on_a, on_b):
        there = start_stream(on_b, "down-b", LONG, _sample(session="sess-down"))
        here = start_stream(on_a, "down-a", LONG, _sample(session="sess-down"))
        await asyncio.wait_for(started(there, here), WAIT_S)
        procs.stop(fleet.redis.proc, signal.SIGKILL)

        with pytest.raises(UnavailableError) as caught:
            await on_a.abort(session_id="sess-down")
        message = str(caught.value.details())
        assert f"state store {fleet.redis.url}" in message and "unavailable" in message, message
        # A's own generation of the session was aborted all the same; B's was not reached.
        await _ended_aborted(here)
        assert not there.task.done()
        # A plain Generate needs no store.
        done = await on_a.generate(_sample(), SHORT, timeout=WAIT_S)
        assert done.status == pb.SAMPLE_STATUS_TRUNCATED and done.response_length == 4

        # The store back on its port: the replicas subscribe again by themselves, and the abort
        # reaches B once they have (each try is an answer; B's re-subscription is the event).
        start_redis(procs, REDIS or "", random.Random(), name="redis-again", port=fleet.redis.port)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while True:
            with contextlib.suppress(UnavailableError):
                if (await on_a.abort(session_id="sess-down")).aborted == 1:
                    break
            assert loop.time() < deadline, "the replicas never re-subscribed to the restarted store"
            await asyncio.sleep(0.1)
        await _ended_aborted(there)
