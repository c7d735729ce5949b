"""The fleet's pause epoch (issue 37): a late resume on one replica never undoes a Pause run on
another. Real `rollout-grpc serve` processes (replicas A and B) on one simulated engine process and
one real redis-server.

B's Resume of an engine whose `/resume` hangs runs out of its control deadline, so B keeps resuming
that engine in the background (`rollout/resumes.py`). A then pauses the engines (as a weight update
does). Once the engine answers resumes again, B's background resume must stop instead of resuming
it: the Pause bumped the fleet's pause epoch in the store, which B reads before each resume. Before
the epoch, B stopped only on a Pause of its own process, and resumed the engine A had paused.

The engine's `resume_fault` (set over its `/_sim/faults` route) makes `/resume` hang, then fail
fast; every wait is on an observed event (an answer, the engine's counters, B's log), bounded.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_grpc.client import AsyncRolloutClient, UnavailableError
from tests.support.processes import Engine, Processes, start_engine, start_replica
from tests.support.redis_server import redis_binary, start_redis

REDIS = redis_binary()

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (.ci/run installs it)"),
]

#: B's control deadline: its Resume of the hung engine gives up after this and goes on in the
#: background.
CONTROL_DEADLINE_S = 2.0
#: Longest any awaited event may take on a loaded machine.
WAIT_S = 60.0


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


async def _stats(engine: Engine) -> dict[str, Any]:
    stats: dict[str, Any] = await _sim(engine, "GET", "stats")
    return stats


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


async def test_a_late_resume_on_one_replica_does_not_undo_a_pause_on_the_other(procs: Processes) -> None:
    assert REDIS is not None
    redis = start_redis(procs, REDIS, random.Random())
    engine = start_engine(procs, "engine", token_delay_ms=1, test_routes=True)
    args = ["--workers", "1", "--state-store", redis.url, "--control-deadline", str(CONTROL_DEADLINE_S)]
    a = start_replica(procs, "replica-a", [engine], args)
    b = start_replica(procs, "replica-b", [engine], args)
    on_a, on_b = AsyncRolloutClient(a.target), AsyncRolloutClient(b.target)
    try:
        await _sim(engine, "POST", "faults", {"resume_fault": "hang"})
        with pytest.raises(UnavailableError, match="resume"):
            await on_b.resume(timeout=WAIT_S)
        # B goes on in the background; its attempts now fail fast (the hung ones answer too).
        await _sim(engine, "POST", "faults", {"resume_fault": "error"})
        seen = (await _stats(engine))["resume_calls"]

        async def b_retried() -> bool:
            return bool(int((await _stats(engine))["resume_calls"]) > int(seen))

        await _until("B's background resume", b_retried)
        # A pauses the shared engines (a weight update's pause), then the engine takes resumes again.
        await on_a.pause("keep")
        assert (await _stats(engine))["paused"]
        await _sim(engine, "POST", "faults", {"resume_fault": ""})

        async def b_stopped_or_engine_resumed() -> bool:
            stopped = b.log_events("engine_resume_stopped_by_pause")
            return bool(stopped) or not bool((await _stats(engine))["paused"])

        await _until("B's background resume to stop, or the engine to resume", b_stopped_or_engine_resumed)
        assert (await _stats(engine))["paused"], "B's late resume undid A's pause"
        assert b.log_events("engine_resume_stopped_by_pause")
        # A's Resume is what ends its pause.
        await on_a.resume()
        assert not (await _stats(engine))["paused"]
    finally:
        await on_a.close()
        await on_b.close()
