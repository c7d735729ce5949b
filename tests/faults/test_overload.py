"""Overload never cancels a call unseen (issue 12 item 9).

grpc.aio picks up new calls from gRPC core one per event-loop turn (one `request_call` outstanding
at a time). When the loop is busy — thousands of streams on slow engines, a loaded machine — calls
wait in core's queue of calls the application has not requested, and core cancels those older than
`grpc.server_max_unrequested_time_in_server` (30 s by default): CANCELLED, without ever reaching
admission, so without a queue slot or a RESOURCE_EXHAUSTED retry hint. The replica holds such
calls for `ServerConfig.max_unrequested_time_s` instead (the caller's deadline still applies).

The test stalls the replica's event loop past core's default (the cause, made deterministic)
while callers on their own threads send more calls than admission runs and queues; every call must
then be served, queued or refused with RESOURCE_EXHAUSTED and its retry hint — none CANCELLED.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.client import make_sample, pb
from rollout_grpc.client.samples import to_params
from tests.faults.support import processes, sim_process
from tests.harness import running_server

#: gRPC core's default hold for unrequested calls is 30 s; the stall outlasts it.
STALL_S = 32.0
CALLS = 16
PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301]


def _call(target: str) -> tuple[grpc.StatusCode, str]:
    """One Generate; its status code and details (a refusal must carry the retry hint)."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        request = pb.GenerateRequest(
            sample=make_sample(PROMPT), sampling_params=to_params({"max_new_tokens": 4, "ignore_eos": True})
        )
        call = stub.Generate(request, timeout=STALL_S + 60)
        try:
            messages = list(call)
        except grpc.RpcError:
            code: grpc.StatusCode = call.code()
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert any(key == "grpc-retry-pushback-ms" for key, _ in call.trailing_metadata() or ())
            return code, call.details() or ""
        assert messages[-1].HasField("sample")
        return grpc.StatusCode.OK, ""


async def test_calls_held_by_a_stalled_event_loop_are_served_not_cancelled(tmp_path: Path) -> None:
    # The engine runs in its own process (the stall is the replica's); no health probe runs
    # during the stall (its timeout would count the stall against the engine).
    with processes(tmp_path) as procs:
        engine = sim_process(procs, "engine", token_delay_ms=20)
        await _stall_and_call(engine.url)


async def _stall_and_call(engine_url: str) -> None:
    # Admission is small (1 running, 2 queued): the held calls must meet it, not gRPC core.
    config = {"health_interval_s": 600.0, "server_concurrency": 1, "max_queue": 2}
    async with running_server([engine_url], **config) as server:
        target = f"127.0.0.1:{server.port}"
        stalled = threading.Event()

        def stall() -> None:
            stalled.set()
            time.sleep(STALL_S)  # the fault: a loop too busy to pick up calls

        def callers() -> list[tuple[grpc.StatusCode, str]]:
            assert stalled.wait(30)
            with ThreadPoolExecutor(CALLS) as pool:
                return list(pool.map(_call, [target] * CALLS))

        results = asyncio.ensure_future(asyncio.to_thread(callers))
        asyncio.get_running_loop().call_soon(stall)
        outcomes = await asyncio.wait_for(results, STALL_S + 90)
        codes = {code for code, _ in outcomes}
        assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, outcomes
        assert grpc.StatusCode.OK in codes
