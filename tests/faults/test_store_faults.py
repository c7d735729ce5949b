"""The state store's faults with real processes (issue 37 item 4): a redis-server that is not there
when `serve` starts, one killed with SIGKILL while a replica runs, and one started again.

* unreachable at start: `serve --state-store redis://127.0.0.1:<closed port>/0` writes one line
  naming the store and exits 1 (one process, and a supervisor of two workers);
* killed mid-run: a step that buffers fails UNAVAILABLE naming the store, while plain Generate
  streams keep working (their row in the fault table);
* started again on its port: the next buffering step works, and its groups continue.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from rollout_grpc.client import make_sample, pb
from tests.faults.support import Outcome, consume
from tests.support.buffered_steps import (
    PROMPT,
    QUICK_LEFT,
    N,
    assert_continued,
    buffering_step,
    continue_step,
    params,
    step_on,
)
from tests.support.partials import aborted_partials
from tests.support.processes import (
    REPO,
    Processes,
    child_env,
    free_listen_port,
    replica_command,
    start_engine,
)
from tests.support.redis_server import redis_binary, start_redis
from tests.support.steps import StepRun
from tests.support.store_fleet import store_fleet
from tests.support.workers import client

Record = Callable[[str, list[Outcome], list[int]], None]

REDIS = redis_binary()

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (.ci/run installs it)"),
]

#: Tokens per sample of the steps.
BUDGET = 60
#: Tokens of the Generate streams that run while the store is down.
TOKENS = 40
STREAMS = 4
#: Bound on `serve` giving up on an unreachable store (it connects once, refused at once).
START_TIMEOUT_S = 120


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


def _plain_lines(text: str) -> list[str]:
    """The lines of `text` that are not JSON log records (what a person reads first)."""
    lines = []
    for line in text.splitlines():
        try:
            json.loads(line)
        except ValueError:
            if line.strip():
                lines.append(line)
    return lines


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_store_unreachable_at_start_is_one_line_and_exit_1(procs: Processes, workers: str) -> None:
    engine = start_engine(procs, "engine", token_delay_ms=1)
    closed = free_listen_port(random.Random())  # bound and released a moment ago: nobody listens
    url = f"redis://127.0.0.1:{closed}/0"
    argv = [*replica_command(), "serve", "--engine", engine.url, "--port", "0", "--workers", workers]
    done = subprocess.run(
        [*argv, "--log-format", "json", "--state-store", url],
        check=False,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        env=child_env(),
        cwd=REPO,
    )
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    lines = _plain_lines(done.stderr + done.stdout)
    assert len(lines) == 1, lines
    assert lines[0].startswith("rollout-grpc serve: the state store ") and url in lines[0], lines[0]
    assert "unavailable" in lines[0]
    assert "Traceback" not in done.stderr


async def test_a_store_killed_mid_run_fails_buffering_steps_only_until_it_is_back(
    procs: Processes, record: Record
) -> None:
    assert REDIS is not None
    fleet = store_fleet(procs, replicas=1)
    [replica] = fleet.replicas
    async with client(replica.target) as trainer:
        before = await buffering_step(trainer, step_id="before", buffer_name="t", budget=BUDGET)
        resumed = await continue_step(
            trainer, step_id="before-2", buffer_name="t", budget=BUDGET, fresh_index=9
        )
        assert_continued(resumed, before, first_step="before", budget=BUDGET)
        reference = await consume(trainer, "reference", TOKENS)
        assert reference.final is not None, reference.error

        os.kill(fleet.redis.proc.pid, signal.SIGKILL)
        assert fleet.redis.proc.popen.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(grpc.RpcError) as failed:
            await buffering_step(trainer, step_id="down", buffer_name="t", budget=BUDGET)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert f"the state store {fleet.redis.url} is unavailable" in str(failed.value.details())
        with pytest.raises(grpc.RpcError) as failed_continue:
            await continue_step(trainer, step_id="down-2", buffer_name="t", budget=BUDGET, fresh_index=9)
        assert failed_continue.value.code() == grpc.StatusCode.UNAVAILABLE, failed_continue.value
        # Generate needs no store: it streams as before.
        streams = [await consume(trainer, f"while-down-{i}", TOKENS) for i in range(STREAMS)]
        record("state store (Redis) killed mid-run: Generate streams meanwhile", streams, reference.response)

        again = start_redis(procs, REDIS, random.Random(), name="redis-again", port=fleet.redis.port)
        assert again.url == fleet.redis.url
        after = await buffering_step(trainer, step_id="after", buffer_name="t", budget=BUDGET)
        resumed = await continue_step(
            trainer, step_id="after-2", buffer_name="t", budget=BUDGET, fresh_index=9
        )
        assert_continued(resumed, after, first_step="after", budget=BUDGET)
    assert replica.proc.popen.poll() is None


#: The mid-step test's budget: its long groups are far from done when the target is reached.
MID_BUDGET = 3000
#: Group 1's tokens still to generate: at the engines' 2 ms a token it ends at least 0.6 s after
#: group 0, long after the test has killed the store on group 0's result.
MEDIUM_LEFT = 300


async def test_a_store_killed_mid_step_hands_the_leftovers_back_with_their_tokens(
    procs: Processes,
) -> None:
    """The target is reached after the store died: the groups the step would have buffered come
    back ABORTED with every token and a reason naming the store (a failure keeps what was
    generated), the step ends with its summary, and Generate keeps working."""
    fleet = store_fleet(procs, replicas=1)
    [replica] = fleet.replicas
    quick = pb.PromptGroup(
        prompt=make_sample(PROMPT),
        group_index=0,
        partial=aborted_partials(PROMPT, 0, N, MID_BUDGET - QUICK_LEFT),
    )
    medium = pb.PromptGroup(
        prompt=make_sample(PROMPT),
        group_index=1,
        partial=aborted_partials(PROMPT, N, N, MID_BUDGET - MEDIUM_LEFT),
    )
    longs = [(make_sample(PROMPT, index=N * i), i) for i in (2, 3)]
    run = StepRun()
    async with client(replica.target) as trainer:
        async for event in trainer.rollout_step(
            [quick, medium, *longs],
            n_samples_per_prompt=N,
            params=params(MID_BUDGET),
            target_groups=2,
            max_groups_in_flight=4,
            over_sampling="keep_in_flight",
            leftovers="buffer",
            buffer_name="mid",
            step_id="mid",
            timeout=120,
        ):
            kind = event.WhichOneof("event")
            if kind == "group":
                run.groups.append(event.group)
                if event.group.group_index == 0:
                    os.kill(fleet.redis.proc.pid, signal.SIGKILL)
                    assert fleet.redis.proc.popen.wait(timeout=30) == -signal.SIGKILL
            elif kind == "summary":
                run.summary = event.summary
        plain = await consume(trainer, "after-mid", 8)
        assert plain.final is not None, plain.error
    assert run.outcomes() == {
        0: pb.GROUP_OUTCOME_ACCEPTED,
        1: pb.GROUP_OUTCOME_ACCEPTED,
        2: pb.GROUP_OUTCOME_ABORTED,
        3: pb.GROUP_OUTCOME_ABORTED,
    }, run.outcomes()
    for index in (2, 3):
        group = run.group(index)
        assert f"the state store {fleet.redis.url} is unavailable" in group.reason, group.reason
        assert "returned instead" in group.reason
        assert len(group.samples) == N
        for sample in group.samples:
            assert sample.status == pb.SAMPLE_STATUS_ABORTED and 0 < sample.response_length < MID_BUDGET
            assert len(sample.tokens) == len(PROMPT) + sample.response_length
            assert len(sample.rollout_log_probs) == len(sample.loss_mask) == sample.response_length
    assert run.summary is not None and run.summary.target_reached and run.summary.accepted == 2
    assert fleet.redis.url in run.summary.reason, run.summary.reason


#: The caller's deadline on a step while the store does not answer.
SLOW_DEADLINE_S = 3.0


async def test_a_store_that_stops_answering_is_bounded_by_the_callers_deadline(procs: Processes) -> None:
    """redis-server stopped (SIGSTOP: connections are accepted, nothing answers): a buffering step
    ends by its deadline (or UNAVAILABLE naming the store, whichever comes first), Generate keeps
    working, and once the store answers again (SIGCONT) the next step works."""
    fleet = store_fleet(procs, replicas=1)
    [replica] = fleet.replicas
    async with client(replica.target) as trainer:
        await buffering_step(trainer, step_id="warm", buffer_name="s", budget=BUDGET)
        os.kill(fleet.redis.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as stuck:
                await step_on(
                    trainer,
                    [(make_sample(PROMPT), 5)],
                    params=params(BUDGET),
                    continue_buffered=True,
                    buffer_name="s",
                    timeout=SLOW_DEADLINE_S,
                )
            assert stuck.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            if stuck.value.code() == grpc.StatusCode.UNAVAILABLE:
                assert fleet.redis.url in str(stuck.value.details())
            plain = await consume(trainer, "while-stopped", 8)
            assert plain.final is not None, plain.error
        finally:
            os.kill(fleet.redis.proc.pid, signal.SIGCONT)
        run = await continue_step(trainer, step_id="resumed", buffer_name="s", budget=BUDGET, fresh_index=9)
        assert_continued(run, [1, 2], first_step="warm", budget=BUDGET)
    assert replica.proc.popen.poll() is None
