"""Signals on a replica process: SIGHUP never kills it; SIGTERM with a hung engine keeps its bound.

The bound is `ServerConfig.shutdown_bound_s()` (rollout_grpc/server/domain/bounds.py), the same number
deploy/k8s's terminationGracePeriodSeconds is checked against.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

from rollout_grpc.client import AsyncRolloutClient, pb
from rollout_grpc.server.app import ServerConfig
from tests.faults.support import Outcome, consume, first_tokens, processes, sim_process, start
from tests.support.processes import Replica, start_replica, wait_until

GRACE_S = 0.5
BOUND_S = ServerConfig(engines=[], grace_s=GRACE_S).shutdown_bound_s()


def _events(replica: Replica, event: str) -> Callable[[], bool]:
    return lambda: bool(replica.log_events(event))


async def test_sighup_without_an_engines_file_is_logged_and_the_replica_keeps_serving(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        engine = sim_process(procs, "engine", token_delay_ms=0)
        replica = start_replica(procs, "replica", [engine])
        replica.proc.popen.send_signal(signal.SIGHUP)
        await asyncio.to_thread(
            wait_until, "the SIGHUP log line", _events(replica, "sighup_engines_unchanged"), replica.proc
        )
        async with AsyncRolloutClient(replica.target) as client:
            out = await consume(client, "after-sighup", 4)
        assert out.final is not None and out.final.status == pb.SAMPLE_STATUS_TRUNCATED
        assert replica.proc.popen.poll() is None


async def _sigterm_with_a_hung_engine(tmp_path: Path) -> tuple[list[Outcome], float, int]:
    """Streams on two engines, one engine SIGSTOPped, then SIGTERM: (outcomes, seconds, exit code)."""
    with processes(tmp_path) as procs:
        good = sim_process(procs, "good")
        hung = sim_process(procs, "hung")
        replica = start_replica(procs, "replica", [good, hung], ["--grace", str(GRACE_S)])
        async with AsyncRolloutClient(replica.target) as client:
            streams = [start(client, f"s{i}", 4000) for i in range(6)]
            await first_tokens(*(out for out, _ in streams))
            hung.proc.popen.send_signal(signal.SIGSTOP)
            began = time.monotonic()
            replica.proc.popen.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.to_thread(replica.proc.popen.wait, BOUND_S + 5.0)
            except Exception:
                code = -1
            elapsed = time.monotonic() - began
            outcomes = [await asyncio.wait_for(task, 30) for _, task in streams]
        return outcomes, elapsed, code


async def test_sigterm_with_a_hung_engine_exits_within_the_bound(tmp_path: Path) -> None:
    _, elapsed, code = await _sigterm_with_a_hung_engine(tmp_path)
    assert code == 0
    assert elapsed <= BOUND_S, f"exit after {elapsed:.1f} s, bound {BOUND_S:.1f} s"


async def test_sigterm_with_a_hung_engine_delivers_every_sample(
    tmp_path: Path, record: Callable[[str, list[Outcome], list[int]], None]
) -> None:
    outcomes, _, code = await _sigterm_with_a_hung_engine(tmp_path)
    # Greedy on one prompt: every stream is a prefix of the longest one.
    longest = max((out.streamed for out in outcomes), key=len)
    record("SIGTERM with a hung engine", outcomes, longest)
    assert code == 0
    for out in outcomes:
        assert out.final is not None, f"{out.request_id}: {out.error}"
        assert out.final.status == pb.SAMPLE_STATUS_ABORTED
