"""A replica (or a worker of `serve --workers 2`) killed with SIGKILL in the middle of a buffering
RolloutStep (issue 37 item 4), with real processes: simulated engines over HTTP, and two
`rollout-grpc serve` replicas sharing one real redis-server, or one replica of two workers sharing
its supervisor's store.

The killed step (`continue_buffered`, `leftovers=BUFFER`) holds five groups when it dies: one
delivered, one buffered (aborted from outside mid-step), two taken from the caller's buffer and
one fresh group still generating. What was in flight dies with the process (its generation cannot
be recovered), but it does not vanish silently: the step's drain lease named those groups in the
store, and when the lease expires unended they move to the caller's lost list. The continue step
on the other replica (worker) continues the buffered group and reports exactly the three others
lost, so every group the killed step started is accounted for: delivered + buffered + lost =
started.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.support.buffered_steps import PROMPT, QUICK_LEFT, N, buffering_step, continue_step, params
from tests.support.partials import aborted_partials
from tests.support.processes import Processes, start_engine
from tests.support.redis_server import redis_binary
from tests.support.steps import StepRun
from tests.support.store_fleet import TOKEN_DELAY_MS, store_fleet
from tests.support.workers import client, clients_by_worker, start_replica

pytestmark = pytest.mark.timeout(240)

#: Tokens per sample: at the engines' 2 ms a token the long groups run for seconds after the kill.
BUDGET = 3000


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


async def _kill_mid_step(
    on_a: AsyncRolloutClient, on_b: AsyncRolloutClient, kill: Callable[[], None]
) -> None:
    """Buffer groups 1 and 2 through A, continue them on A with groups 10 (nearly done), 11 and 12,
    abort group 11 into the buffer once 10 is delivered, `kill` A, continue on B and check that
    every group of the killed step is delivered, buffered or reported lost, once."""
    taken = await buffering_step(on_a, step_id="s1", buffer_name="k", budget=BUDGET)
    assert taken == [1, 2]
    quick = pb.PromptGroup(
        prompt=make_sample(PROMPT),
        group_index=10,
        partial=aborted_partials(PROMPT, 0, N, BUDGET - QUICK_LEFT),
    )
    fresh = [(make_sample(PROMPT, index=N * i), i) for i in (11, 12)]
    killed, dead = StepRun(), False
    with pytest.raises(grpc.RpcError) as died:
        async for event in on_a.rollout_step(
            [quick, *fresh],
            n_samples_per_prompt=N,
            params=params(BUDGET),
            continue_buffered=True,
            max_groups_in_flight=5,
            over_sampling="keep_in_flight",  # all five start at once
            leftovers="buffer",
            buffer_name="k",
            step_id="s2",
            timeout=120,
        ):
            kind = event.WhichOneof("event")
            if kind == "group":
                killed.groups.append(event.group)
                if event.group.group_index == 10:
                    await on_a.abort(group_index=11)  # buffered mid-step: it survives the kill
            elif kind == "progress" and 11 in killed.outcomes() and not dead:
                # The progress after group 11's event: the step has named the groups it still holds
                # in the store by now. The others are mid-generation.
                kill()
                dead = True
            elif kind == "summary":
                killed.summary = event.summary
    assert died.value.code() == grpc.StatusCode.UNAVAILABLE, died.value
    assert killed.summary is None
    assert killed.outcomes() == {10: pb.GROUP_OUTCOME_ACCEPTED, 11: pb.GROUP_OUTCOME_BUFFERED}

    # On B: waits for the dead step's lease to expire, then continues what was buffered.
    after = await continue_step(on_b, step_id="s3", buffer_name="k", budget=BUDGET, fresh_index=20)
    assert after.summary is not None
    lost = sorted(after.summary.lost_group_indexes)
    assert lost == [1, 2, 12], (lost, after.outcomes())
    assert after.outcomes() == {11: pb.GROUP_OUTCOME_ACCEPTED, 20: pb.GROUP_OUTCOME_ACCEPTED}
    for sample in after.group(11).samples:
        assert sample.start_step_id == "s2" and sample.response_length == BUDGET
        before = list(sample.loss_mask).count(0)
        assert list(sample.loss_mask) == [0] * before + [1] * (BUDGET - before)
    # Every group the killed step started is accounted for, once.
    started = {*taken, 10, 11, 12}
    delivered = {i for i, o in killed.outcomes().items() if o == pb.GROUP_OUTCOME_ACCEPTED}
    buffered = {11} & set(after.outcomes())
    assert sorted([*delivered, *buffered, *lost]) == sorted(started)


#: The dead step's lease expires this long after the kill (the continue step waits it out): shorter
#: than the 15 s default, with room for a renewal (every third of it) on a loaded machine.
LEASE_ARGS = ("--step-drain-lease-ttl-s", "5")


@pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (.ci/run installs it)")
async def test_a_replica_killed_mid_step_has_its_groups_in_flight_reported_lost_on_the_other(
    procs: Processes,
) -> None:
    fleet = store_fleet(procs, replica_args=LEASE_ARGS)
    a, b = fleet.replicas

    def kill() -> None:
        os.kill(a.proc.pid, signal.SIGKILL)
        assert a.proc.popen.wait(timeout=30) == -signal.SIGKILL

    on_a, on_b = client(a.target), client(b.target)
    try:
        await _kill_mid_step(on_a, on_b, kill)
    finally:
        await on_a.close()
        await on_b.close()


async def test_a_worker_killed_mid_step_has_its_groups_in_flight_reported_lost_on_the_other(
    procs: Processes, tmp_path: Path
) -> None:
    """The same with `serve --workers 2`: the lease and the held groups are in the supervisor."""
    engines = [
        start_engine(procs, f"engine-{i}", "--eos-probability", "0", token_delay_ms=TOKEN_DELAY_MS, seed=i)
        for i in range(2)
    ]
    replica = start_replica(
        procs, tmp_path, "--workers", "2", *LEASE_ARGS, *(f"--engine={e.url}" for e in engines)
    )
    victim = replica.ports["worker_pids"][1]
    async with clients_by_worker(replica.target, 2) as by_index:
        await _kill_mid_step(by_index[1], by_index[0], lambda: os.kill(victim, signal.SIGKILL))
