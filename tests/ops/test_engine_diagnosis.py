"""Engine mistakes are diagnosed: the health probe's cause reaches the log, GetServerInfo and the
UNAVAILABLE message, per engine (issue 23.2). Before, every case said `health probe failed` and
Generate said `no healthy engine is available`, naming none."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import structlog
from aiohttp import web

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.info import render
from rollout_grpc.server.security.redact import engine_label
from tests.harness import running_server
from tests.security.credentials import TRAINER_A

WAIT_S = 20.0


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def not_vllm() -> AsyncIterator[str]:
    """An HTTP server that answers, but has none of vLLM's routes (a wrong port)."""
    app = web.Application()

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def silent() -> AsyncIterator[str]:
    """A port that accepts connections and never answers."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def _until_diagnosed(client: AsyncRolloutClient, count: int) -> pb.GetServerInfoResponse:
    """GetServerInfo once `count` engines carry a health error (polled: the probe runs every 0.2 s)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            info = await client.server_info()
            if sum(1 for e in info.engines if e.health_error) == count:
                return info
            await asyncio.sleep(0.1)


async def test_each_dead_or_wrong_engine_says_why_everywhere() -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    async with not_vllm() as wrong, silent() as hung:
        with structlog.testing.capture_logs() as logs:
            async with running_server([dead, wrong, hung], health_interval_s=0.2) as server:
                target = f"127.0.0.1:{server.port}"
                async with AsyncRolloutClient(target) as client:
                    info = await _until_diagnosed(client, 3)
                by_url = {e.url: e for e in info.engines}
                assert "connection refused" in by_url[dead].health_error
                assert "not a vLLM server" in by_url[wrong].health_error
                assert "no answer within" in by_url[hung].health_error
                assert not any(e.healthy for e in info.engines)
                table = render(info, "NOT_SERVING", target)
                assert f"UNHEALTHY  {dead}: connection refused" in table

                async with AsyncRolloutClient(target, retry=None) as client:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await client.generate(make_sample([1, 2, 3]), {"max_new_tokens": 2})
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                message = refused.value.details() or ""
                assert "no healthy engine is available" in message
                for url, cause in ((dead, "connection refused"), (wrong, "not a vLLM server")):
                    assert f"{url}: unhealthy: " in message and cause in message
    unhealthy = [e for e in logs if e.get("event") == "engine_unhealthy"]
    causes = {e["engine"]: e["error"] for e in unhealthy}
    assert "connection refused" in causes[dead] and "not a vLLM server" in causes[wrong]
    assert all(e["error"] != "health probe failed" for e in unhealthy)


async def test_a_trainer_sees_labels_not_engine_addresses(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice trainer {TRAINER_A}\n")
    async with running_server([dead], auth_tokens_file=str(tokens)) as server:
        target = f"127.0.0.1:{server.port}"
        async with AsyncRolloutClient(target, token=TRAINER_A, retry=None) as client:
            info = await _until_diagnosed(client, 1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate(make_sample([1, 2, 3]), {"max_new_tokens": 2})
    address = dead.removeprefix("http://")
    assert info.engines[0].url == engine_label(dead) and address not in info.engines[0].health_error
    message = refused.value.details() or ""
    assert "connection refused" in message and engine_label(dead) in message and address not in message


def test_labels_replace_engine_addresses_in_causes() -> None:
    from rollout_grpc.server.security.redact import redact_text

    url = "http://10.1.2.3:8000"
    text = "Cannot connect to host 10.1.2.3:8000 ssl:default; engine http://10.1.2.3:8000 refused"
    redacted = redact_text(text, [url])
    assert "10.1.2.3" not in redacted and redacted.count(engine_label(url)) == 2
