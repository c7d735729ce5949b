"""Routing decisions of the engine pool and admission limits."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rollout_grpc.server.app import rollout_num_engines
from rollout_grpc.server.domain.errors import ResourceExhausted
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.engines.registry import adapter_factory
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.inflight import AbortedWhileQueued, InFlight

URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]


async def test_session_affinity_is_stable_across_pools() -> None:
    async with aiohttp.ClientSession() as session:
        a, b = (
            EnginePool(URLS, adapter_factory(session)),
            EnginePool(list(reversed(URLS)), adapter_factory(session)),
        )
        for sid in (f"s{i}" for i in range(50)):
            first, second = a.pick(sid), b.pick(sid)
            assert first is not None and second is not None
            assert first.url == second.url


async def test_hot_session_spills_over_under_bounded_load() -> None:
    async with aiohttp.ClientSession() as session:
        pool = EnginePool(URLS, adapter_factory(session))
        home = pool.pick("hot")
        assert home is not None
        home.in_flight = 10
        other = pool.pick("hot")
        assert other is not None and other.url != home.url


async def test_least_outstanding_without_session() -> None:
    async with aiohttp.ClientSession() as session:
        pool = EnginePool(URLS, adapter_factory(session))
        for i, e in enumerate(pool.engines):
            e.in_flight = 5 - i
        chosen = pool.pick()
        assert chosen is not None and chosen.url == URLS[3]
        pool.engines[3].healthy = False
        chosen = pool.pick()
        assert chosen is not None and chosen.url == URLS[2]
        assert pool.pick(exclude={u for u in URLS}) is None


def test_engine_count_never_zero() -> None:
    assert rollout_num_engines(0, 1, 0) == 1
    assert rollout_num_engines(8, 2, 0) == 4
    assert rollout_num_engines(None, 1, 3) == 3


async def test_admission_queues_then_refuses() -> None:
    admission = Admission(limit=1, max_queue=1)
    entries = [InFlight(f"r{i}") for i in range(3)]
    holder = admission.slot(entries[0])
    await holder.__aenter__()
    waiter = asyncio.create_task(admission.slot(entries[1]).__aenter__())
    await asyncio.sleep(0)
    assert admission.queued == 1
    with pytest.raises(ResourceExhausted):
        await admission.slot(entries[2]).__aenter__()
    entries[1].request_abort("test")
    with pytest.raises(AbortedWhileQueued):
        await waiter
    await holder.__aexit__(None, None, None)
    assert admission.running == 0


def test_engine_calls_are_traced_only_when_their_debug_lines_are_kept() -> None:
    """aiohttp builds trace objects for every signal of every request once a trace config is set;
    the debug log's is worth that only at debug level (`logs.configure`, once per process)."""
    import structlog

    from rollout_grpc import logs
    from rollout_grpc.server.observe.httplog import engine_calls_logged

    try:
        logs.configure("info")
        assert not engine_calls_logged()
        logs.configure("debug")
        assert engine_calls_logged()
    finally:
        structlog.reset_defaults()
    assert engine_calls_logged()  # structlog's default keeps every level


class _HealthServer:
    """An engine's /health on its own thread, answering only once the test's loop is stalled."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.got_request = threading.Event()
        self.stall_started = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.got_request.set()
                outer.stall_started.wait(10)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stall_started.set()
        self.httpd.shutdown()
        self.httpd.server_close()


async def test_a_probe_timed_out_by_a_stalled_event_loop_asks_again() -> None:
    """After a stall of the replica's loop, a probe's timeout runs before the reply already in the
    socket is read: that is not an engine's silence, and must not mark a live engine dead."""
    import time

    def stall() -> None:
        time.sleep(2 * 0.2 + 1.5)  # the fault: the loop stalls past the probe's timeout

    server = _HealthServer()
    try:
        async with aiohttp.ClientSession() as http:
            client = adapter_factory(http)(server.url)
            probe = asyncio.ensure_future(client.health(timeout=0.2))
            assert await asyncio.to_thread(server.got_request.wait, 10)
            server.stall_started.set()
            stall()
            health = await asyncio.wait_for(probe, 10)
        assert health, health.cause
    finally:
        server.close()


async def _sse_server_that_breaks(go: asyncio.Event, chunk: bytes) -> tuple[asyncio.Server, int]:
    """An HTTP server that answers a streaming head, then, once `go` is set, one chunk of `chunk`
    and its connection's end (FIN) without the body's last chunk: a broken SSE body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        await go.wait()
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_data_received_just_before_the_connection_broke_is_still_read() -> None:
    """aiohttp raises a broken body's error before handing out what it had buffered; the engine
    reader hands it out first (the engine made those tokens), then raises."""
    from rollout_grpc.server.engines.http import HttpEngine

    event = b'{"choices": [{"index": 0, "token_ids": [7, 8]}]}'

    async def scenario() -> list[bytes]:
        go = asyncio.Event()
        server, port = await _sse_server_that_breaks(go, b"data: " + event + b'\n\ndata: {"trunc')
        got: list[bytes] = []
        try:
            async with aiohttp.ClientSession() as session:
                engine = HttpEngine(f"http://127.0.0.1:{port}", session)
                async with session.post(engine.url + "/generate", json={}) as resp:
                    broken = asyncio.Event()
                    assert resp.connection is not None and resp.connection.protocol is not None
                    protocol = resp.connection.protocol
                    connection_lost = protocol.connection_lost

                    def note_break(exc: BaseException | None) -> None:
                        connection_lost(exc)
                        broken.set()

                    protocol.connection_lost = note_break  # type: ignore[method-assign]
                    go.set()
                    # Both the chunk and the connection's end are processed before the first read,
                    # as on a busy replica.
                    await broken.wait()
                    assert resp.content.exception() is not None
                    with pytest.raises(aiohttp.ClientPayloadError):
                        async for payloads in engine._events(resp):
                            got.extend(payloads)
        finally:
            server.close()
            await server.wait_closed()
        return got

    assert asyncio.run(scenario()) == [event]  # the complete event; the torn one after it is not
