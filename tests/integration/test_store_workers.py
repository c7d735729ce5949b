"""`serve --workers 2` with the embedded store: a buffer written by one worker is continued by the
other (issue 37 item 5), with real processes: a `rollout-grpc serve` supervisor and its two
workers, two simulated engines over HTTP.

Each round runs its buffering step on one worker and its continue step on the other (alternating),
on connections each worker is known to serve (`GetServerInfo.worker`, and the worker's pid from
the port file): a continue served by the worker that buffered would prove nothing.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_grpc.server.state.api import BufferCaps
from tests.support.buffered_steps import abandoned_step, assert_continued, buffering_step, continue_step
from tests.support.processes import Processes, start_engine
from tests.support.workers import clients_by_worker, start_replica

pytestmark = pytest.mark.timeout(600)

ROUNDS = 100
#: Tokens per sample: the long groups are still generating when group 0 is accepted.
BUDGET = 40
#: The engines' per-token delay (ms): 40 tokens take ~0.1 s.
TOKEN_DELAY_MS = 2
#: A deadline under the drain lease's lifetime (`BufferCaps.lease_ttl_s`, 15 s) and far over a
#: 40-token continue step.
UNDER_LEASE_TTL_S = 0.6 * BufferCaps().lease_ttl_s


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


async def test_a_buffer_written_by_one_worker_is_continued_by_the_other_every_time(
    procs: Processes, tmp_path: Path
) -> None:
    engines = [
        start_engine(procs, f"engine-{i}", "--eos-probability", "0", token_delay_ms=TOKEN_DELAY_MS, seed=i)
        for i in range(2)
    ]
    replica = start_replica(procs, tmp_path, "--workers", "2", *(f"--engine={e.url}" for e in engines))
    pids = replica.ports["worker_pids"]
    assert len(set(pids)) == 2
    misses: list[str] = []
    async with clients_by_worker(replica.target, 2) as by_index:
        for index, on in by_index.items():
            info = await on.server_info()
            assert info.worker == index and info.workers == 2
        for round_ in range(ROUNDS):
            writer, reader = (0, 1) if round_ % 2 == 0 else (1, 0)
            name = f"trainer-{round_}"
            buffered = await buffering_step(
                by_index[writer], step_id=f"w{round_}", buffer_name=name, budget=BUDGET
            )
            run = await continue_step(
                by_index[reader], step_id=f"r{round_}", buffer_name=name, budget=BUDGET, fresh_index=9
            )
            try:
                assert_continued(run, buffered, first_step=f"w{round_}", budget=BUDGET)
            except AssertionError as exc:
                misses.append(f"round {round_} (worker {writer} -> {reader}): {exc}")
        # Both workers still serve the connections the test placed on them (no restart between).
        assert {(await c.server_info()).worker for c in by_index.values()} == {0, 1}
    assert replica.ports["worker_pids"] == pids
    assert not misses, f"{len(misses)} of {ROUNDS} rounds missed:\n" + "\n".join(misses[:10])


#: Rounds of the leave-and-continue test (each leaves a step on one worker).
LEAVE_ROUNDS = 20
#: Budget of the left steps: their long groups are far from done when the caller leaves.
LEAVE_BUDGET = 200


async def test_a_trainer_that_leaves_a_step_on_one_worker_continues_at_once_on_the_other(
    procs: Processes, tmp_path: Path
) -> None:
    """No race by construction: a BUFFER step's drain lease is in the shared store from its start,
    so a continue step sent the moment the caller left (on the other worker) waits for it and gets
    every group."""
    engines = [
        start_engine(procs, f"engine-{i}", "--eos-probability", "0", token_delay_ms=TOKEN_DELAY_MS, seed=i)
        for i in range(2)
    ]
    replica = start_replica(procs, tmp_path, "--workers", "2", *(f"--engine={e.url}" for e in engines))
    misses: list[str] = []
    async with clients_by_worker(replica.target, 2) as by_index:
        for round_ in range(LEAVE_ROUNDS):
            writer, reader = (0, 1) if round_ % 2 == 0 else (1, 0)
            name = f"leaver-{round_}"
            left = await abandoned_step(
                by_index[writer],
                step_id=f"l{round_}",
                buffer_name=name,
                budget=LEAVE_BUDGET,
                leftovers="buffer",
            )
            run = await continue_step(
                by_index[reader], step_id=f"c{round_}", buffer_name=name, budget=LEAVE_BUDGET, fresh_index=9
            )
            try:
                assert_continued(run, left, first_step=f"l{round_}", budget=LEAVE_BUDGET)
            except AssertionError as exc:
                misses.append(f"round {round_} (worker {writer} -> {reader}): {exc}")
    assert not misses, f"{len(misses)} of {LEAVE_ROUNDS} rounds missed:\n" + "\n".join(misses[:10])


async def test_groups_buffered_by_a_worker_killed_with_sigkill_continue_on_the_other(
    procs: Processes, tmp_path: Path
) -> None:
    """The embedded store lives in the supervisor, not in a worker: a worker's death loses none of
    the groups it buffered."""
    engines = [
        start_engine(procs, f"engine-{i}", "--eos-probability", "0", token_delay_ms=TOKEN_DELAY_MS, seed=i)
        for i in range(2)
    ]
    replica = start_replica(procs, tmp_path, "--workers", "2", *(f"--engine={e.url}" for e in engines))
    victim = replica.ports["worker_pids"][1]
    async with clients_by_worker(replica.target, 2) as by_index:
        buffered = await buffering_step(by_index[1], step_id="dies", buffer_name="k", budget=BUDGET)
        os.kill(victim, signal.SIGKILL)
        # The step's drain lease was released before its summary left: the continue step does not
        # wait for the dead worker's lease to expire (that takes the lease's whole lifetime).
        run = await continue_step(
            by_index[0],
            step_id="lives",
            buffer_name="k",
            budget=BUDGET,
            fresh_index=9,
            timeout=UNDER_LEASE_TTL_S,
        )
        assert (await by_index[0].server_info()).worker == 0
    assert_continued(run, buffered, first_step="dies", budget=BUDGET)
    assert replica.proc.popen.poll() is None
