"""A replica killed with SIGKILL in the middle of a buffering RolloutStep (issue 37 item 4), with
real processes: two `rollout-grpc serve` replicas sharing one real redis-server, simulated engines
over HTTP.

The killed step (`continue_buffered`, `leftovers=BUFFER`) holds five groups when it dies: one
delivered, one buffered (aborted from outside mid-step), two taken from the caller's buffer and
one fresh group still generating. What was in flight dies with the process (its generation cannot
be recovered), but it does not vanish silently: the step's drain lease named those groups in the
store, and when the lease expires unended they move to the caller's lost list. The continue step
on the other replica continues the buffered group and reports exactly the three others lost, so
every group the killed step started is accounted for: delivered + buffered + lost = started.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rollout_grpc.client import make_sample, pb
from tests.support.buffered_steps import PROMPT, QUICK_LEFT, N, buffering_step, continue_step, params
from tests.support.partials import aborted_partials
from tests.support.processes import Processes
from tests.support.redis_server import redis_binary
from tests.support.steps import StepRun
from tests.support.store_fleet import store_fleet
from tests.support.workers import client

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed (.ci/run installs it)"),
]

#: Tokens per sample: at the engines' 2 ms a token the long groups run for seconds after the kill.
BUDGET = 3000


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


async def test_a_replica_killed_mid_step_has_its_groups_in_flight_reported_lost_on_the_other(
    procs: Processes,
) -> None:
    fleet = store_fleet(procs)
    a, b = fleet.replicas
    on_a, on_b = client(a.target), client(b.target)
    try:
        taken = await buffering_step(on_a, step_id="s1", buffer_name="k", budget=BUDGET)
        assert taken == [1, 2]
        quick = pb.PromptGroup(
            prompt=make_sample(PROMPT),
            group_index=10,
            partial=aborted_partials(PROMPT, 0, N, BUDGET - QUICK_LEFT),
        )
        fresh = [(make_sample(PROMPT, index=N * i), i) for i in (11, 12)]
        killed = StepRun()
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
                elif kind == "progress" and 11 in killed.outcomes() and a.proc.popen.poll() is None:
                    # The progress after group 11's event: the step has named the groups it still
                    # holds in the store by now. The others are mid-generation.
                    os.kill(a.proc.pid, signal.SIGKILL)
                    assert a.proc.popen.wait(timeout=30) == -signal.SIGKILL
                elif kind == "summary":
                    killed.summary = event.summary
        assert died.value.code() == grpc.StatusCode.UNAVAILABLE, died.value
        assert killed.summary is None
        assert killed.outcomes() == {10: pb.GROUP_OUTCOME_ACCEPTED, 11: pb.GROUP_OUTCOME_BUFFERED}

        # On B: waits for the dead step's lease to expire, then continues what was buffered.
        after = await continue_step(on_b, step_id="s3", buffer_name="k", budget=BUDGET, fresh_index=20)
    finally:
        await on_a.close()
        await on_b.close()

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
