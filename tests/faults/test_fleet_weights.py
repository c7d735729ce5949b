"""Weight updates and the weight-version order across replicas sharing one state store (issues 36
and 37): real `rollout-grpc serve` processes on one simulated engine process and one real
redis-server, and a `serve --workers 2` replica on its embedded store.

* two UpdateWeights at once, one per replica: exactly one proceeds; the other is refused
  FAILED_PRECONDITION naming the replica that holds the fleet lease, and touches no engine;
* a Resume(weight_version) on replica A is the newest version for a step on replica B (its
  admission bound measures the trainer's lag against it);
* a replica SIGKILLed while it holds the lease blocks updates only until the lease's TTL;
* the same lease across the two workers of one replica;
* a Pause on replica A holds what replica B admits (the pause lives in the shared engines), until
  A's Resume.

The engine's `load_fault = "hang"` (set over its `/_sim/faults` route) holds an update in its load
step for as long as a test needs: every wait here is on an observed event (the engine's load
counter, a call's answer), bounded, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_grpc.client import AsyncRolloutClient, FailedPreconditionError, make_sample, pb
from tests.support.checkpoints import toy_checkpoint
from tests.support.processes import Engine, Processes, Replica, start_engine, start_replica
from tests.support.redis_server import RedisServer, redis_binary, start_redis
from tests.support.workers import clients_by_worker
from tests.support.workers import start_replica as start_workers

REDIS = redis_binary()

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (.ci/run installs it)"),
]

#: Seconds the lease outlives a replica that stopped renewing it: the kill test waits it out, and
#: its first refusal after the kill must come before it (seconds of margin on a loaded machine).
LEASE_TTL_S = 10.0
#: Longest any awaited event may take on a loaded machine.
WAIT_S = 60.0


@dataclass
class Fleet:
    redis: RedisServer
    engine: Engine
    a: Replica
    b: Replica
    checkpoints: Path


async def _until(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    """Poll `check` until it holds (every 20 ms, at most `WAIT_S`): waits on an event, bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not await check():
        assert loop.time() < deadline, f"{what}: not within {WAIT_S:g} s"
        await asyncio.sleep(0.02)


async def _sim(engine: Engine, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, f"{engine.url}/_sim/{route}", json=body) as reply,
    ):
        assert reply.status == 200, await reply.text()
        return await reply.json()


async def _loads(engine: Engine) -> int:
    return int((await _sim(engine, "GET", "stats"))["weight_loads"])


def _replica_args(redis_url: str, checkpoints: Path) -> list[str]:
    return [
        "--workers", "1",
        "--state-store", redis_url,
        "--weights-path-prefix", str(checkpoints),
        "--weights-lease-ttl", str(LEASE_TTL_S),
    ]  # fmt: skip


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


@pytest.fixture
def fleet(procs: Processes, tmp_path: Path) -> Fleet:
    assert REDIS is not None
    redis = start_redis(procs, REDIS, random.Random())
    engine = start_engine(procs, "engine", token_delay_ms=1, test_routes=True)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    args = _replica_args(redis.url, checkpoints)
    a = start_replica(procs, "replica-a", [engine], args)
    b = start_replica(procs, "replica-b", [engine], args)
    return Fleet(redis, engine, a, b, checkpoints)


@contextlib.asynccontextmanager
async def _clients(*targets: str) -> AsyncIterator[list[AsyncRolloutClient]]:
    clients = [AsyncRolloutClient(t) for t in targets]
    try:
        yield clients
    finally:
        for c in clients:
            await c.close()


async def _hang_loads(engine: Engine, on: bool) -> None:
    await _sim(engine, "POST", "faults", {"load_fault": "hang" if on else ""})


async def test_concurrent_updates_on_two_replicas_one_proceeds_the_other_is_refused(fleet: Fleet) -> None:
    v1, v2 = toy_checkpoint(fleet.checkpoints / "v1", 1), toy_checkpoint(fleet.checkpoints / "v2", 2)
    await _hang_loads(fleet.engine, True)
    async with _clients(fleet.a.target, fleet.b.target) as (on_a, on_b):
        calls = {
            asyncio.create_task(on_a.update_weights(str(v1), "a-1", all_at_once=True)): fleet.a,
            asyncio.create_task(on_b.update_weights(str(v2), "b-1", all_at_once=True)): fleet.b,
        }
        # The refused one answers while the other hangs in its load.
        done, pending = await asyncio.wait(calls, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and len(pending) == 1
        [refused], [running] = done, pending
        with pytest.raises(FailedPreconditionError) as caught:
            refused.result()
        holder = calls[running]
        message = str(caught.value)
        assert "fleet lease" in message and f"pid {holder.proc.pid} " in message, message
        await _until("the running update's load", lambda: _has(_loads(fleet.engine), 1))
        # A colocated trainer's memory release is serialised with the update too.
        other = on_b if holder is fleet.a else on_a
        with pytest.raises(FailedPreconditionError, match=f"release memory: .*pid {holder.proc.pid} "):
            await other.release_memory()
        await _hang_loads(fleet.engine, False)
        result = await asyncio.wait_for(running, WAIT_S)
    assert result.weight_version == ("a-1" if holder is fleet.a else "b-1")
    stats = await _sim(fleet.engine, "GET", "stats")
    assert stats["weight_loads"] == 1 and stats["weight_version"] == result.weight_version


async def _has(count: Awaitable[int], expected: int) -> bool:
    return await count == expected


GROUPS = [pb.PromptGroup(prompt=make_sample([1, 2, 3, 100 + g], index=g), group_index=g) for g in range(2)]
SHORT = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True, "seed": 7}


async def _step_summary(client: AsyncRolloutClient, **policies: Any) -> pb.StepSummary:
    summary = None
    async for event in client.rollout_step(
        GROUPS, n_samples_per_prompt=1, params=SHORT, timeout=WAIT_S, **policies
    ):
        if event.WhichOneof("event") == "summary":
            summary = event.summary
    assert summary is not None
    return summary


async def test_a_resume_on_one_replica_is_the_newest_version_for_a_step_on_the_other(fleet: Fleet) -> None:
    async with _clients(fleet.a.target, fleet.b.target) as (on_a, on_b):
        await on_a.pause()
        await on_a.resume(weight_version="v1")
        within = await _step_summary(on_b, consumed_weight_version="v1", max_head_offpolicyness=0)
        assert within.accepted == len(GROUPS)
        await on_a.pause()
        await on_a.resume(weight_version="v2")
        # B never saw a Resume: its lag of the trainer's "v1" is measured against A's "v2".
        behind = await _step_summary(on_b, consumed_weight_version="v1", max_head_offpolicyness=0)
        assert behind.accepted == 0
        assert re.search(r"'v1' is 1 versions behind the newest 'v2'", behind.reason), behind.reason
        # Versions never go backwards fleet-wide: B refuses the older label, touching no engine.
        with pytest.raises(FailedPreconditionError, match="'v1' goes backwards: the fleet's newest is 'v2'"):
            await on_b.resume(weight_version="v1")
    assert (await _sim(fleet.engine, "GET", "stats"))["weight_version"] == "v2"


async def test_a_replica_killed_holding_the_lease_blocks_updates_only_until_its_ttl(fleet: Fleet) -> None:
    v1, v2 = toy_checkpoint(fleet.checkpoints / "v1", 1), toy_checkpoint(fleet.checkpoints / "v2", 2)
    await _hang_loads(fleet.engine, True)
    async with _clients(fleet.a.target, fleet.b.target) as (on_a, on_b):
        held = asyncio.create_task(on_a.update_weights(str(v1), "a-1", all_at_once=True))
        await _until("A's load", lambda: _has(_loads(fleet.engine), 1))
        fleet.a.proc.popen.send_signal(signal.SIGKILL)
        fleet.a.proc.popen.wait(WAIT_S)
        with pytest.raises(Exception):  # noqa: B017 - its connection died with it
            await held
        await _hang_loads(fleet.engine, False)
        with pytest.raises(FailedPreconditionError, match=f"pid {fleet.a.proc.pid} "):
            await on_b.update_weights(str(v2), "b-1")
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = None
        while result is None:  # each refusal is an answer; the lease's expiry is the event
            try:
                result = await on_b.update_weights(str(v2), "b-1")
            except FailedPreconditionError:
                assert loop.time() - started < WAIT_S, "the killed replica's lease never expired"
                await asyncio.sleep(0.05)
        waited = loop.time() - started
    assert result.weight_version == "b-1" and all(e.updated for e in result.engines)
    assert waited <= LEASE_TTL_S + WAIT_S / 2
    assert (await _sim(fleet.engine, "GET", "stats"))["weight_version"] == "b-1"


async def test_the_lease_holds_across_the_workers_of_one_replica(procs: Processes, tmp_path: Path) -> None:
    engine = start_engine(procs, "engine", token_delay_ms=1, test_routes=True)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    replica = start_workers(
        procs,
        tmp_path,
        "--engine", engine.url,
        "--workers", "2",
        "--weights-path-prefix", str(checkpoints),
        "--weights-lease-ttl", str(LEASE_TTL_S),
    )  # fmt: skip
    v1, v2 = toy_checkpoint(checkpoints / "v1", 1), toy_checkpoint(checkpoints / "v2", 2)
    await _hang_loads(engine, True)
    async with clients_by_worker(replica.target, 2) as by_worker:
        first = asyncio.create_task(by_worker[0].update_weights(str(v1), "w0-1", all_at_once=True))
        await _until("worker 0's load", lambda: _has(_loads(engine), 1))
        with pytest.raises(FailedPreconditionError, match=r"fleet lease on worker 0 of replica"):
            await by_worker[1].update_weights(str(v2), "w1-1")
        await _hang_loads(engine, False)
        assert (await asyncio.wait_for(first, WAIT_S)).weight_version == "w0-1"
        # Released at its end: the other worker's update now proceeds, and the version order is
        # the replica's (the embedded store), so worker 0's label cannot be reused on worker 1.
        with pytest.raises(FailedPreconditionError, match="w0-1"):
            await by_worker[1].update_weights(str(v2), "w0-1")
        assert (await by_worker[1].update_weights(str(v2), "w1-1")).weight_version == "w1-1"
    assert (await _sim(engine, "GET", "stats"))["weight_version"] == "w1-1"


async def test_a_pause_on_one_replica_holds_what_the_other_admits_until_the_resume(fleet: Fleet) -> None:
    """Pause lives in the engines, which the fleet shares: a Generate and a RolloutStep admitted on
    B while A's Pause(keep) holds are held by the engine exactly as on A (not refused, not failed
    over), B reports the engines paused, and A's Resume lets them finish with every token."""
    budget = SHORT["max_new_tokens"]
    async with _clients(fleet.a.target, fleet.b.target) as (on_a, on_b):
        await on_a.pause("keep")
        info = await on_b.server_info()
        assert info.paused and [e.paused for e in info.engines] == [True]

        async def generate() -> pb.Sample:
            sample = await on_b.generate(make_sample([1, 2, 3]), SHORT, timeout=WAIT_S)
            return sample

        generated = asyncio.create_task(generate())
        stepped = asyncio.create_task(_step_summary(on_b))
        # The engine holds all three requests (one Generate, two groups of one sample).
        await _sim(fleet.engine, "POST", "wait", {"held": 1 + len(GROUPS), "timeout_s": WAIT_S})
        assert not generated.done() and not stepped.done()
        await on_a.resume()
        sample, summary = await asyncio.wait_for(asyncio.gather(generated, stepped), WAIT_S)
    assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == budget
    assert summary.accepted == len(GROUPS) and summary.target_reached
