"""Abort(all), Pause and Resume with hung, dead and misconfigured engines (issues 12.3 and 14.2).

One overall deadline per fan-out, unhealthy engines skipped, the abort-all window closed within the
deadline; and when no engine did what was asked the RPC fails loudly, with what to do about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from aiohttp import web

from rollout_grpc.client import AsyncRolloutClient, EngineErrors, pb
from tests.faults.support import (
    Outcome,
    consume,
    first_tokens,
    processes,
    silent_server,
    sim_process,
    start,
)
from tests.harness import running_server, sim_engines
from tests.support.service import SLOW_SIM, start_stream, started

DEADLINE_S = 2.0
#: Scheduling slack on a loaded 2-core machine; far below what a hung engine used to cost (>2 min).
SLACK_S = 1.5


def _closed_port_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_abort_all_with_a_stopped_engine_returns_within_the_deadline(
    tmp_path: Path, record: Callable[[str, list[Outcome], list[int]], None]
) -> None:
    with processes(tmp_path) as procs:
        good = sim_process(procs, "good")
        hung = sim_process(procs, "hung")
        async with (
            running_server(
                [good.url, hung.url],
                control_deadline_s=DEADLINE_S,
                engine_read_timeout_s=DEADLINE_S,
                health_interval_s=60.0,  # the probe has not noticed the hang yet
            ) as server,
            AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
        ):
            streams = [start(client, f"s{i}", 4000) for i in range(6)]
            await first_tokens(*(out for out, _ in streams))
            hung.proc.popen.send_signal(signal.SIGSTOP)

            began = time.monotonic()
            response = await client.abort(all=True, raise_on_engine_errors=False)
            elapsed = time.monotonic() - began
            assert elapsed < DEADLINE_S + SLACK_S, f"Abort(all) took {elapsed:.1f} s"
            assert response.aborted == 6
            assert [e.engine for e in response.engine_errors] == [hung.url]
            assert "no answer within" in response.engine_errors[0].error

            # The abort-all window is closed: a new call runs normally on the good engine.
            fresh = await consume(client, "after", 8)
            assert fresh.final is not None and fresh.final.status == pb.SAMPLE_STATUS_TRUNCATED

            outcomes = [await asyncio.wait_for(task, 30) for _, task in streams]
            # Greedy on one prompt: every stream is a prefix of the longest one.
            longest = max((out.streamed for out in outcomes), key=len)
            record("Abort(all) with a SIGSTOPped engine", outcomes, longest)
            for out in outcomes:
                assert out.final is not None and out.final.status == pb.SAMPLE_STATUS_ABORTED, out.error


async def test_unhealthy_engines_are_skipped_and_reported() -> None:
    async with (
        sim_engines(1) as sims,
        running_server([sims[0].url, _closed_port_url()], control_deadline_s=DEADLINE_S) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        dead = server.pool.engines[1]
        assert not dead.healthy
        for call in (
            client.abort(all=True, raise_on_engine_errors=False),
            client.pause("keep", raise_on_engine_errors=False),
            client.resume("v2", raise_on_engine_errors=False),
        ):
            response = await call
            assert [(e.engine, e.error.split(":")[0]) for e in response.engine_errors] == [
                (dead.url, "skipped")
            ]


async def test_pause_resume_abort_and_info_with_a_silent_engine_end_by_the_deadline() -> None:
    async with (
        sim_engines(1, **SLOW_SIM) as sims,
        silent_server() as silent,
        running_server(
            [sims[0].url, silent], control_deadline_s=DEADLINE_S, health_interval_s=60.0
        ) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        # The start-up probe of the silent engine timed out: mark it healthy again, as a probe
        # would have seen it a moment before it wedged.
        server.pool.engines[1].healthy = True
        for call, done in (
            (client.pause("keep", raise_on_engine_errors=False), "paused_engines"),
            (client.resume("v2", raise_on_engine_errors=False), "resumed_engines"),
        ):
            began = time.monotonic()
            response = await call
            assert time.monotonic() - began < DEADLINE_S + SLACK_S
            assert list(getattr(response, done)) == [sims[0].url]
            assert [e.engine for e in response.engine_errors] == [silent]
        # An abort by id goes to the engines only for generations found here (engine ids of other
        # replicas cannot be built): run one on the healthy engine, then abort it.
        server.pool.engines[1].healthy = False
        running = start_stream(client, "victim")
        await started(running)
        server.pool.engines[1].healthy = True
        began = time.monotonic()
        aborted = await client.abort(request_ids=["victim"], raise_on_engine_errors=False)
        assert time.monotonic() - began < DEADLINE_S + SLACK_S
        assert aborted.aborted == 1 and [e.engine for e in aborted.engine_errors] == [silent]
        assert (await running.task).status == pb.SAMPLE_STATUS_ABORTED
        began = time.monotonic()
        info = await client.server_info()
        assert time.monotonic() - began < DEADLINE_S + SLACK_S
        assert [e.url for e in info.engines] == [sims[0].url, silent]


async def test_engines_without_dev_mode_fail_the_control_calls_loudly() -> None:
    async with (
        sim_engines(2, dev_mode=False) as sims,
        running_server([s.url for s in sims], control_deadline_s=DEADLINE_S) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        for call in (client.pause("keep"), client.resume("v2"), client.resume(), client.abort(all=True)):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "VLLM_SERVER_DEV_MODE=1" in (failed.value.details() or "")
            assert '{"detail"' not in (failed.value.details() or "")


async def test_unreachable_engines_fail_the_control_calls_as_unavailable() -> None:
    async with (
        sim_engines(1) as sims,
        running_server([sims[0].url], control_deadline_s=DEADLINE_S, health_interval_s=60.0) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        await server.pool.stop()  # no probe notices the loss: the call itself finds out
        await sims[0].stop()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await client.pause("keep")
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "unreachable" in (failed.value.details() or "")


async def test_partial_failures_are_actionable_and_the_clients_raise_by_default() -> None:
    async with (
        sim_engines(1) as with_dev,
        sim_engines(1, dev_mode=False) as without_dev,
        running_server([with_dev[0].url, without_dev[0].url], control_deadline_s=DEADLINE_S) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        with pytest.raises(EngineErrors) as raised:
            await client.pause("keep")
        assert [e.engine for e in raised.value.engine_errors] == [without_dev[0].url]
        assert "VLLM_SERVER_DEV_MODE=1" in raised.value.engine_errors[0].error
        paused = raised.value.response
        assert isinstance(paused, pb.PauseResponse) and list(paused.paused_engines) == [with_dev[0].url]

        resumed = await client.resume("v3", raise_on_engine_errors=False)
        assert list(resumed.resumed_engines) == [with_dev[0].url]
        assert all("VLLM_SERVER_DEV_MODE=1" in e.error for e in resumed.engine_errors)
        assert all('{"detail"' not in e.error for e in resumed.engine_errors)


def test_the_sync_client_raises_on_engine_errors_too(tmp_path: Path) -> None:
    from rollout_grpc.client import RolloutClient

    async def serve_and_call() -> None:
        async with (
            sim_engines(1) as with_dev,
            sim_engines(1, dev_mode=False) as without_dev,
            running_server([with_dev[0].url, without_dev[0].url]) as server,
        ):

            def call() -> None:
                with RolloutClient(f"127.0.0.1:{server.port}") as client:
                    with pytest.raises(EngineErrors):
                        client.pause("keep")
                    response = client.resume(raise_on_engine_errors=False)
                    assert len(response.engine_errors) == 1

            await asyncio.to_thread(call)

    asyncio.run(serve_and_call())


async def test_a_silent_peer_delays_a_session_abort_by_at_most_the_deadline() -> None:
    async with (
        sim_engines(1) as sims,
        silent_server() as silent,
        running_server(
            [sims[0].url], peers=[silent.removeprefix("http://")], control_deadline_s=DEADLINE_S
        ) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        began = time.monotonic()
        response = await client.abort(session_id="sess")
        assert time.monotonic() - began < DEADLINE_S + SLACK_S
        assert response.aborted == 0


# ------------------------------------------------------------------------------ a pause that lands late


@contextlib.asynccontextmanager
async def late_pause_engine(late_s: float) -> AsyncIterator[LatePause]:
    """An engine whose /pause takes effect `late_s` after it was asked, answered or not.

    What a SIGSTOPped vLLM does when it wakes up: the pause request whose caller gave up is still in
    its socket buffer and is executed then — possibly after the resume sent in the meantime.
    """
    state = LatePause()

    async def pause(request: web.Request) -> web.Response:
        async def land() -> None:
            await asyncio.sleep(late_s)  # the fault: the pause takes effect late
            state.paused = True
            state.landed.set()

        state.pending = asyncio.ensure_future(land())  # runs even when the caller hangs up
        await asyncio.shield(state.pending)
        return web.json_response({"status": "paused"})

    async def resume(request: web.Request) -> web.Response:
        state.paused = False
        if state.landed.is_set():
            state.resumed_after_landing.set()
        return web.json_response({"status": "resumed"})

    async def is_paused(request: web.Request) -> web.Response:
        return web.json_response({"is_paused": state.paused})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        state.url = f"http://127.0.0.1:{port}"
        yield state
    finally:
        if state.pending is not None:
            state.pending.cancel()
        await runner.cleanup()


@dataclass
class LatePause:
    """What the late-pause engine went through."""

    url: str = ""
    paused: bool = False
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    resumed_after_landing: asyncio.Event = field(default_factory=asyncio.Event)
    pending: asyncio.Future[None] | None = None


async def test_an_engine_whose_pause_lands_after_the_deadline_is_resumed_again() -> None:
    """Abort(all) resumes every engine; a pause that takes effect after that resume must not win.

    Seen on real vLLM (tests/vllm/test_vllm_faults.py): after a SIGSTOP, the engine woke up, ran the
    unanswered pause and stayed paused, holding every later request until its caller's deadline.
    """
    deadline_s = 0.5
    async with (
        sim_engines(1) as sims,
        late_pause_engine(late_s=2 * deadline_s) as late,
        running_server(
            [sims[0].url, late.url], control_deadline_s=deadline_s, health_interval_s=60.0
        ) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        server.pool.engines[1].healthy = True  # whatever its start-up probes made of the stub
        response = await client.abort(all=True, raise_on_engine_errors=False)
        assert [e.engine for e in response.engine_errors] == [late.url]
        await asyncio.wait_for(late.landed.wait(), 10)
        # The pause landed after the abort's resume: the replica must notice and resume again.
        await asyncio.wait_for(late.resumed_after_landing.wait(), 10)
        assert not late.paused
