"""Two replicas sharing one real redis-server (`--state-store redis://...`), with real processes:
simulated engines over HTTP, `rollout-grpc serve` replicas, and the tested nginx config in front
(issue 37 items 3 and 5).

* A step through nginx buffers groups on the replica that served it; that replica is killed with
  SIGKILL; the continue step through nginx lands on the other replica and gets every buffered
  group, each sample finished at exactly its budget, every token the dead replica generated kept.
* Anonymous callers with different buffer names, on different replicas, never see each other's
  groups.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_grpc.client import AsyncRolloutClient, pb
from tests.support.buffered_steps import (
    QUICK_LEFT,
    N,
    abandoned_step,
    assert_continued,
    buffering_step,
    continue_step,
)
from tests.support.processes import Processes, nginx_binary
from tests.support.redis_server import redis_binary
from tests.support.store_fleet import store_fleet
from tests.support.workers import client

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (.ci/run installs it)"),
]

#: Tokens per sample (~0.2 s at the engines' 2 ms a token).
BUDGET = 100


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (.ci/run installs it)")
async def test_groups_buffered_on_a_replica_killed_with_sigkill_continue_on_the_other(
    procs: Processes,
) -> None:
    fleet = store_fleet(procs, nginx=True)
    assert fleet.nginx is not None
    name = "trainer-a"
    async with client(fleet.nginx.target) as trainer:
        buffered = await buffering_step(trainer, step_id="on-a", buffer_name=name, budget=BUDGET)
        served, record = fleet.served_by("on-a")
        generated_on_a = int(str(record["new_tokens"]))
        victim = fleet.replicas[served]
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert victim.proc.popen.wait(timeout=30) == -signal.SIGKILL
        run = await continue_step(trainer, step_id="on-b", buffer_name=name, budget=BUDGET, fresh_index=9)
    other, _ = fleet.served_by("on-b")
    assert other != served
    assert_continued(run, buffered, first_step="on-a", budget=BUDGET)
    # Every token the killed replica generated came back: group 0's, and the buffered groups'
    # (their loss_mask 0 part), no more and no less.
    kept = sum(
        list(s.loss_mask).count(0) for g in run.groups if g.group_index in set(buffered) for s in g.samples
    )
    assert kept + N * QUICK_LEFT == generated_on_a, (kept, generated_on_a)
    fresh = [g for g in run.groups if g.group_index == 9]
    assert len(fresh) == 1 and fresh[0].outcome == pb.GROUP_OUTCOME_ACCEPTED
    assert all(list(s.loss_mask) == [1] * BUDGET for s in fresh[0].samples)


async def test_anonymous_callers_with_different_buffer_names_never_see_each_others_groups(
    procs: Processes,
) -> None:
    fleet = store_fleet(procs)
    a, b = fleet.replicas
    on: dict[str, AsyncRolloutClient] = {"a": client(a.target), "b": client(b.target)}
    try:
        # "x" buffers on A, "y" on B: the same group indexes, different steps.
        x = await buffering_step(on["a"], step_id="x1", buffer_name="x", budget=BUDGET)
        y = await buffering_step(on["b"], step_id="y1", buffer_name="y", budget=BUDGET)
        # A third name on B gets none of them (only its own fresh group).
        z = await continue_step(on["b"], step_id="z2", buffer_name="z", budget=BUDGET, fresh_index=9)
        assert [(g.group_index, g.outcome) for g in z.groups] == [(9, pb.GROUP_OUTCOME_ACCEPTED)]
        assert {s.start_step_id for g in z.groups for s in g.samples} == {"z2"}
        # Each continues on the replica that did not buffer its groups, and gets its own only.
        x2 = await continue_step(on["b"], step_id="x2", buffer_name="x", budget=BUDGET, fresh_index=9)
        y2 = await continue_step(on["a"], step_id="y2", buffer_name="y", budget=BUDGET, fresh_index=9)
    finally:
        for c in on.values():
            await c.close()
    assert_continued(x2, x, first_step="x1", budget=BUDGET)
    assert_continued(y2, y, first_step="y1", budget=BUDGET)
    for run, mine in ((x2, "x"), (y2, "y")):
        starts = {s.start_step_id for g in run.groups for s in g.samples}
        assert starts == {f"{mine}1", f"{mine}2"}, starts
        assert sorted(g.group_index for g in run.groups) == [1, 2, 9]


#: Rounds of the leave-and-continue test across replicas, and the left steps' budget.
LEAVE_ROUNDS = 10
LEAVE_BUDGET = 200


async def test_a_trainer_that_leaves_a_step_on_one_replica_continues_at_once_on_the_other(
    procs: Processes,
) -> None:
    """A BUFFER step's drain lease is in Redis from its start: a continue step sent to the other
    replica the moment the caller left waits for the drain and gets every group. (A RETURN step
    takes its lease only once its replica sees the caller leave: tests/integration/
    test_step_store_calls.py.)"""
    fleet = store_fleet(procs)
    a, b = fleet.replicas
    on = [client(a.target), client(b.target)]
    misses: list[str] = []
    try:
        for round_ in range(LEAVE_ROUNDS):
            writer, reader = on[round_ % 2], on[1 - round_ % 2]
            name = f"leaver-{round_}"
            left = await abandoned_step(
                writer, step_id=f"l{round_}", buffer_name=name, budget=LEAVE_BUDGET, leftovers="buffer"
            )
            run = await continue_step(
                reader, step_id=f"c{round_}", buffer_name=name, budget=LEAVE_BUDGET, fresh_index=9
            )
            try:
                assert_continued(run, left, first_step=f"l{round_}", budget=LEAVE_BUDGET)
            except AssertionError as exc:
                misses.append(f"round {round_}: {exc}")
    finally:
        for c in on:
            await c.close()
    assert not misses, f"{len(misses)} of {LEAVE_ROUNDS} rounds missed:\n" + "\n".join(misses)
