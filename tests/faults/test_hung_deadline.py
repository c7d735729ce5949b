"""A hung engine under callers with deadlines (issue 24 item 6).

Trainers set deadlines. An engine that stops (SIGSTOP: a wedged GPU, a stuck process) leaves its
streams silent; the health probe marks it unhealthy within ~3 s, but before the fix its streams
waited for the 30 s idle timeout, so callers with a 25 s deadline got DEADLINE_EXCEEDED and their
streamed tokens never reached a final sample. The promise checked here:

* a stream on an engine the health probe declared dead fails over at once, from the tokens
  produced (one engine stopped: every stream completes, 0 tokens lost against the greedy reference);
* with no engine left to fail over to (both stopped), it ends ABORTED with its tokens, long before
  the deadline;
* whatever the engines do (no probe at all here), a stream whose caller's deadline is about to
  expire ends with its sample first: ABORTED with every token kept, `min(1 s, 10 %)` before it.

The engine idle timeout is the default (30 s), longer than the deadlines: only the new rules can
save the streams.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_grpc.client import AsyncRolloutClient, pb
from tests.faults.support import Outcome, consume, first_tokens, processes, sim_process
from tests.harness import running_server

Record = Callable[[str, list[Outcome], list[int]], None]

STREAMS = 16
#: Long enough that every stream is mid-generation when its engine stops (10 ms a token).
TOKENS = 300
DEADLINE_S = 25.0


@dataclass
class Run:
    """What the callers saw, how long their streams took, and the uninterrupted greedy response."""

    outcomes: list[Outcome]
    elapsed_s: float
    reference: list[int]


async def stop_under_deadlines(tmp_path: Path, stopped: int, deadline_s: float, **config: Any) -> Run:
    """Two engines in processes of their own, STREAMS streams with the callers' deadline, and
    `stopped` engines SIGSTOPped once every stream has its first token."""
    settings = {"health_interval_s": 1.0, "engine_idle_timeout_s": 30.0, **config}
    with processes(tmp_path) as procs:
        engines = [sim_process(procs, f"engine-{i}", "--seed", str(i), token_delay_ms=10) for i in range(2)]
        async with (
            running_server([e.url for e in engines], **settings) as server,
            AsyncRolloutClient(f"127.0.0.1:{server.port}", retry=None) as client,
        ):
            reference = await consume(client, "reference", TOKENS)
            assert reference.final is not None, reference.error
            outcomes = [Outcome(f"s{i}") for i in range(STREAMS)]
            began = time.monotonic()
            tasks = [
                asyncio.create_task(consume(client, out.request_id, TOKENS, out, timeout=deadline_s))
                for out in outcomes
            ]
            await first_tokens(*outcomes)
            for engine in engines[:stopped]:
                engine.proc.popen.send_signal(signal.SIGSTOP)
            results = [await asyncio.wait_for(task, deadline_s + 30) for task in tasks]
            return Run(results, time.monotonic() - began, reference.response)


async def test_one_engine_stopped_under_callers_deadlines_fails_over_at_once(
    tmp_path: Path, record: Record
) -> None:
    run = await stop_under_deadlines(tmp_path, 1, DEADLINE_S)
    record("engine SIGSTOP, callers' 25 s deadline", run.outcomes, run.reference)
    for out in run.outcomes:
        assert out.final is not None
        assert out.final.status == pb.SAMPLE_STATUS_TRUNCATED, pb.SampleStatus.Name(out.final.status)
    assert any(len(o.final.engine_attempts) == 2 for o in run.outcomes if o.final)  # failed over


async def test_both_engines_stopped_end_aborted_with_their_tokens_before_the_deadline(
    tmp_path: Path, record: Record
) -> None:
    run = await stop_under_deadlines(tmp_path, 2, DEADLINE_S)
    record("both engines SIGSTOP, callers' 25 s deadline", run.outcomes, run.reference)
    _aborted_with_tokens(run.outcomes)
    # The probe found them dead: the streams ended long before the deadline's margin.
    assert run.elapsed_s < DEADLINE_S - 5, run.elapsed_s


async def test_a_caller_deadline_ends_the_stream_with_its_sample_first(
    tmp_path: Path, record: Record
) -> None:
    # No health probe: only the caller's deadline can end the silent streams before 30 s.
    deadline_s = 6.0
    run = await stop_under_deadlines(tmp_path, 2, deadline_s, health_interval_s=600.0)
    record("both engines SIGSTOP, no probe, callers' 6 s deadline", run.outcomes, run.reference)
    _aborted_with_tokens(run.outcomes)
    assert run.elapsed_s < deadline_s, run.elapsed_s


def _aborted_with_tokens(outcomes: list[Outcome]) -> None:
    for out in outcomes:
        assert out.final is not None, f"{out.request_id}: {out.error}"
        assert out.final.status == pb.SAMPLE_STATUS_ABORTED, pb.SampleStatus.Name(out.final.status)
        assert out.streamed, f"{out.request_id}: no token before the engines stopped"
