"""Engine faults injected under live streams of a real replica (issue 12, "Must show").

For every fault, every stream must end with exactly one final sample holding exactly its deltas
(or a clean error before any token), and lose no token against an uninterrupted greedy reference.
Engines run with the same model seed, so greedy decoding is the same sequence on each of them and a
failover continues it exactly. The engine idle timeout is set explicitly here (1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout_grpc.client import AsyncRolloutClient, pb
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.sim import SimEngine
from tests.faults.support import Outcome, consume, first_tokens, processes, silent_server, sim_process, start
from tests.harness import running_server, sim_engines

Record = Callable[[str, list[Outcome], list[int]], None]

TOKENS = 80
STREAMS = 4
IDLE_TIMEOUT_S = 1.0
SIM = {"token_delay_s": 0.01, "eos_probability": 0.0}
REPLICA: dict[str, Any] = {
    "engine_read_timeout_s": IDLE_TIMEOUT_S,
    "engine_connect_timeout_s": IDLE_TIMEOUT_S,
    "health_interval_s": 60.0,  # faults are found by the calls, not by a probe racing them
    "control_deadline_s": 2.0,
}


#: The HTTP faults and their failover run on both simulated engine kinds.
KINDS = pytest.mark.parametrize("engine_kind", ["vllm", "sglang"])


@contextlib.asynccontextmanager
async def fleet(engine_kind: str, count: int) -> AsyncIterator[tuple[list[SimEngine], dict[str, Any]]]:
    """`count` simulated engines of `engine_kind`, and the replica settings that name their kind."""
    if engine_kind == "vllm":
        async with sim_engines(count, **SIM) as sims:
            yield sims, {}
        return
    async with sim_engines(count, **SIM, kind="sglang") as sims:
        yield sims, {"engine_kinds": {s.url: "sglang" for s in sims}}


def label(fault: str, engine_kind: str) -> str:
    """The fault table's row name (SGLang rows say so)."""
    return fault if engine_kind == "vllm" else f"{fault} (SGLang)"


@contextlib.asynccontextmanager
async def replica(urls: list[str], **config: Any) -> AsyncIterator[tuple[RolloutServer, AsyncRolloutClient]]:
    async with (
        running_server(urls, **{**REPLICA, **config}) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        yield server, client


async def reference(client: AsyncRolloutClient) -> list[int]:
    """The uninterrupted greedy response (taken before any fault is switched on)."""
    out = await consume(client, "reference", TOKENS)
    assert out.final is not None and out.final.response_length == TOKENS, out.error
    return out.response


async def run_streams(
    client: AsyncRolloutClient, inject: Callable[[], object] | None = None, prefix: str = "s"
) -> list[Outcome]:
    """STREAMS streams; `inject()` once every stream has its first token; every outcome."""
    streams = [start(client, f"{prefix}{i}", TOKENS) for i in range(STREAMS)]
    if inject is not None:
        await first_tokens(*(out for out, _ in streams))
        result = inject()
        if asyncio.iscoroutine(result):
            await result
    return [await asyncio.wait_for(task, 60) for _, task in streams]


def completed(outcomes: list[Outcome]) -> None:
    for out in outcomes:
        assert out.final is not None, f"{out.request_id}: {out.error}"
        assert out.final.status == pb.SAMPLE_STATUS_TRUNCATED, pb.SampleStatus.Name(out.final.status)


# ------------------------------------------------------------------------------------ processes


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
async def test_an_engine_process_killed_or_stopped_mid_stream(
    tmp_path: Path, record: Record, sig: int
) -> None:
    with processes(tmp_path) as procs:
        engines = [sim_process(procs, f"engine-{i}", "--seed", str(i), token_delay_ms=10) for i in range(2)]
        async with replica([e.url for e in engines]) as (_, client):
            ref = await reference(client)
            victim = engines[0]

            def inject() -> None:
                victim.proc.popen.send_signal(sig)

            outcomes = await run_streams(client, inject)
            record(f"engine {signal.Signals(sig).name} mid-stream", outcomes, ref)
            completed(outcomes)
            assert any(len(o.final.engine_attempts) == 2 for o in outcomes if o.final)  # failed over


# ------------------------------------------------------------------------------------ sockets


def _backlog_full() -> Iterator[tuple[str, socket.socket]]:
    """A port whose listen backlog is full: connects to it hang (a slow-connect engine)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}", listener
    finally:
        for s in [*fillers, listener]:
            s.close()


@pytest.mark.parametrize("kind", ["accept-never-answer", "slow-connect"])
@KINDS
async def test_an_engine_that_never_answers(record: Record, kind: str, engine_kind: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        sims, kinds = await stack.enter_async_context(fleet(engine_kind, 1))
        if kind == "accept-never-answer":
            bad = await stack.enter_async_context(silent_server())
        else:
            bad, _ = stack.enter_context(contextlib.contextmanager(_backlog_full)())
        server, client = await stack.enter_async_context(replica([sims[0].url, bad], **kinds))
        ref = await reference(client)
        server.pool.engines[1].healthy = True  # as a probe saw it just before it wedged
        outcomes = await run_streams(client)
        record(label(f"engine {kind}", engine_kind), outcomes, ref)
        completed(outcomes)


# ------------------------------------------------------------------------------------ HTTP faults


@KINDS
async def test_http_500_engine_wide(record: Record, engine_kind: str) -> None:
    async with fleet(engine_kind, 2) as (sims, kinds), replica([s.url for s in sims], **kinds) as (_, client):
        ref = await reference(client)
        sims[0].faults.http_500 = -1
        outcomes = await run_streams(client)
        record(label("HTTP 500 engine-wide", engine_kind), outcomes, ref)
        completed(outcomes)


@KINDS
async def test_http_500_request_specific(record: Record, engine_kind: str) -> None:
    async with fleet(engine_kind, 2) as (sims, kinds), replica([s.url for s in sims], **kinds) as (_, client):
        ref = await reference(client)
        for sim in sims:
            sim.faults.http_500 = 1  # this request fails on every engine it tries
        bad = await consume(client, "bad", TOKENS)
        outcomes = await run_streams(client)  # the other callers are not hurt
        record(label("HTTP 500 request-specific", engine_kind), [bad, *outcomes], ref)
        assert bad.final is None and bad.error is not None
        assert bad.error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        completed(outcomes)


@KINDS
async def test_sse_error_event_mid_stream(record: Record, engine_kind: str) -> None:
    """vLLM: an error event; SGLang: the final chunk an abort with status_code 500."""
    async with fleet(engine_kind, 1) as (sims, kinds), replica([sims[0].url], **kinds) as (_, client):
        ref = await reference(client)
        sims[0].faults.stream_error = STREAMS
        sims[0].faults.stream_error_after = 5
        outcomes = await run_streams(client)
        record(label("SSE error event after 5 tokens", engine_kind), outcomes, ref)
        # The engine stays healthy, so the failure is the request's: the call is retried from the
        # 5 tokens it has (failover policy), and the stream completes without losing one.
        completed(outcomes)
        for out in outcomes:
            assert out.final is not None
            assert out.final.engine_attempts[0].end == 5 and out.final.engine_attempts[0].error


@KINDS
async def test_all_engines_down(record: Record, engine_kind: str) -> None:
    async with (
        fleet(engine_kind, 2) as (sims, kinds),
        replica([s.url for s in sims], **kinds) as (server, client),
    ):
        ref = await reference(client)
        await server.pool.stop()  # no probe: the calls find out
        for sim in sims:
            await sim.stop()
        outcomes = await run_streams(client)
        record(label("all engines down", engine_kind), outcomes, ref)
        for out in outcomes:
            assert out.final is None and out.error is not None
            assert out.error.code() == grpc.StatusCode.UNAVAILABLE, out.error


# ------------------------------------------------------------------------------------ malformed replies

MALFORMED_KINDS = [
    "invalid_json",
    "array_chunk",
    "missing_logprob",
    "string_token_ids",
    "bad_weight_spans",
    "huge_line",
    "negative_token_ids",
]


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
async def test_malformed_engine_reply(record: Record, kind: str) -> None:
    async with sim_engines(2, **SIM) as sims, replica([s.url for s in sims]) as (_, client):
        ref = await reference(client)
        sims[0].faults.update({"malformed": STREAMS, "malformed_kind": kind, "malformed_after": 3})
        outcomes = await run_streams(client)
        record(f"malformed reply: {kind}", outcomes, ref)
        for out in outcomes:
            if out.final is not None:
                assert all(t >= 0 for t in out.final.tokens)
