"""A worker of `serve --workers 2` killed with SIGKILL under live streams (issue 34 item 11).

The row in the fault table is the other worker's streams: they must all end as if nothing had
happened (one final sample holding their deltas, 0 tokens lost against the greedy reference). The
killed worker's streams end UNAVAILABLE without a sample (nothing of a SIGKILLed process survives;
docs/workers.md "A worker that dies" says what a client sees), and are checked to do exactly that:
an error, never a hang and never a wrong sample. Their engine requests end as well: the worker's
HTTP connections close with it and the engine aborts each request (the engines run in processes
of their own here, so their `/_sim/*` counters are read over HTTP).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from tests.faults.support import Outcome, consume, first_tokens, start
from tests.support.processes import Processes, start_engine
from tests.support.workers import clients_by_worker, start_replica

Record = Callable[[str, list[Outcome], list[int]], None]

pytestmark = pytest.mark.timeout(180)

STREAMS = 4
#: Still running when the worker is killed (10 ms a token), done soon after.
TOKENS = 150
#: The engines: 10 ms a token, with the `/_sim/*` routes.
SIM: dict[str, Any] = {"token_delay_ms": 10, "test_routes": True}
#: The killed worker's streams: only their abort can end them within the test (30 s of tokens).
LONG = 3000


async def engine_stats(session: aiohttp.ClientSession, url: str, idle: bool = False) -> dict[str, object]:
    """An engine's counters; with `idle`, once it tracks no request (at most 20 s)."""
    if idle:
        async with session.post(f"{url}/_sim/wait", json={"idle": True, "timeout_s": 20}) as reply:
            assert reply.status == 200, await reply.text()
    async with session.get(f"{url}/_sim/stats") as reply:
        stats: dict[str, object] = await reply.json()
        return stats


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


async def test_a_killed_worker_leaves_the_other_workers_streams_whole(
    procs: Processes, tmp_path: Path, record: Record
) -> None:
    engines = [
        start_engine(
            procs,
            f"engine-{i}",
            "--eos-probability",
            "0",
            "--seed",
            str(i),
            token_delay_ms=10,
            test_routes=True,
        )
        for i in range(2)
    ]
    urls = [e.url for e in engines]
    replica = start_replica(procs, tmp_path, "--workers", "2", *(f"--engine={url}" for url in urls))
    victim_pid = replica.ports["worker_pids"][1]
    async with clients_by_worker(replica.target, 2) as by_index:
        reference = await consume(by_index[0], "reference", TOKENS)
        assert reference.final is not None, reference.error
        kept = [start(by_index[0], f"kept-{i}", TOKENS) for i in range(STREAMS)]
        killed = [start(by_index[1], f"killed-{i}", LONG) for i in range(STREAMS)]
        await first_tokens(*(out for out, _ in kept + killed))
        os.kill(victim_pid, signal.SIGKILL)
        survivors = [await asyncio.wait_for(task, 60) for _, task in kept]
        victims = [await asyncio.wait_for(task, 60) for _, task in killed]
        # The surviving worker still takes new calls (it is not being drained).
        after = await consume(by_index[0], "after-the-kill", 8)
        assert after.final is not None, after.error
    record(
        f"worker SIGKILL (serve --workers 2): the other worker's {STREAMS} streams",
        survivors,
        reference.response,
    )
    for out in victims:
        assert out.final is None and out.error is not None, out.request_id
        assert out.error.code() == grpc.StatusCode.UNAVAILABLE, out.error
    assert replica.proc.popen.poll() is None  # the replica is still up
    # The engines generate nothing more for the dead worker: every request of its ended long
    # before its budget (they were aborted when its connections closed).
    async with aiohttp.ClientSession() as session:
        stats = [await engine_stats(session, url, idle=True) for url in urls]
    assert sum(int(s["disconnects"]) for s in stats) >= STREAMS, stats  # type: ignore[call-overload]
