"""A pooled keep-alive connection the server has closed is not a failure of the server
(rewards/connections.py, rewards/jsonpost.py).

Reward and environment servers close idle keep-alive connections on their own clock (uvicorn after
5 s, gunicorn after 2 s), sooner than the replica's pool lets them go (15 s). Usually the close
arrives first and the pool discards the connection; when the client reuses it just as the server
closes it, the POST goes out on a dead connection and comes back with no answer. That is the pool's
artefact, not the server failing: JsonPoster sends it again at once on a new connection, outside
the caller's `max_retries` and without backoff. A connection the POST opened itself and the server
dropped unanswered stays an ordinary failed attempt.

What a retry guarantees: at least once. The stale connection was closed unanswered (an idle server
reads nothing), so the request is applied once; a server that did read it and died before
answering may see it twice, which rewards (scores) and environments (a repeated `(episode_id,
turn)` is answered the same way, docs/episodes.md) allow by contract.

Real servers on loopback: aiohttp with a short `keepalive_timeout`, and a minimal HTTP/1.1 server
that closes a kept-alive connection when the next request arrives on it (the race, made exact).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from rollout_grpc.server.rewards.connections import PostConnections
from rollout_grpc.server.rewards.jsonpost import JsonPoster

#: The minimal server's answer: the JSON number 1.0, the connection kept alive.
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 3\r\n\r\n1.0"
#: Seconds a test may wait for a server to close an idle connection.
DEADLINE_S = 5.0


def poster(
    url: str, pool: PostConnections | None, *, max_retries: int = 0, backoff_s: float = 60.0
) -> JsonPoster:
    """No retries by default: a stale connection counted as a failed attempt fails the post.
    The backoff is long, so a stale connection retried as an ordinary attempt would show."""
    return JsonPoster(
        url,
        what="reward",
        timeout_s=DEADLINE_S,
        max_retries=max_retries,
        backoff_s=backoff_s,
        max_concurrency=1,
        max_reply_bytes=1 << 10,
        connections=pool,
    )


async def test_a_connection_the_server_closed_while_idle_is_not_a_failure() -> None:
    """aiohttp closes a kept-alive connection after `keepalive_timeout`; the next post succeeds
    on a new connection, with no retry to spend, and is applied once."""
    handled: list[object] = []
    transports: list[asyncio.Transport] = []
    peers: set[object] = set()

    async def handle(request: web.Request) -> web.Response:
        assert request.transport is not None
        transports.append(request.transport)
        peers.add(request.transport.get_extra_info("peername"))
        handled.append(await request.json())
        return web.json_response(1.0)

    app = web.Application()
    app.router.add_post("/rm", handle)
    runner = web.AppRunner(app, keepalive_timeout=0.05)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pool = PostConnections()
    client = poster(f"http://127.0.0.1:{port}/rm", pool)
    try:
        assert await client.post({"n": 1}) == 1.0
        deadline = asyncio.get_running_loop().time() + DEADLINE_S
        while not transports[0].is_closing():  # poll for the server's idle close, with a deadline
            assert asyncio.get_running_loop().time() < deadline, "the server never closed the idle connection"
            await asyncio.sleep(0.01)
        assert await client.post({"n": 2}) == 1.0
    finally:
        await client.close()
        await pool.close()
        await runner.cleanup()
    assert handled == [{"n": 1}, {"n": 2}], "each post applied once"
    assert len(peers) == 2, "the second post came on a new connection"


class ClosingServer:
    """Minimal HTTP/1.1: answers the first request of a connection and keeps it open; when another
    request arrives on it, closes it unanswered and unread (`rst`: with a reset) — to the client,
    exactly a server whose idle timer fired as the pooled connection was reused. With
    `drop_first`, the first request of a connection is read, applied and then dropped unanswered
    (a server that dies mid-request). With `busy_first`, the server's first request of all is
    answered 503 (retryable), the connection kept alive."""

    def __init__(self, *, rst: bool = False, drop_first: bool = False, busy_first: bool = False) -> None:
        self.rst = rst
        self.drop_first = drop_first
        self.busy_first = busy_first
        self.handled: list[object] = []
        self.dropped = 0
        self.connections = 0
        self.url = ""

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if answered:
                    self.dropped += 1
                    self._close(writer)
                    return
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                body = await reader.readexactly(int(length.group(1)) if length else 0)
                self.handled.append(json.loads(body))
                if self.drop_first:
                    self.dropped += 1
                    self._close(writer)
                    return
                if self.busy_first and len(self.handled) == 1:
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
                else:
                    writer.write(ANSWER)
                await writer.drain()
                answered = True
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def _close(self, writer: asyncio.StreamWriter) -> None:
        if self.rst:
            writer.transport.abort()
        else:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ClosingServer]:
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/rm"
        try:
            yield self
        finally:
            server.close()
            await server.wait_closed()


@pytest.mark.parametrize("rst", [False, True], ids=["fin", "rst"])
async def test_a_pooled_connection_closed_as_it_is_reused_is_sent_again_at_once(rst: bool) -> None:
    """The race made exact: the post that reuses the connection gets no answer; it goes out again
    on a new connection, outside `max_retries` (0 here) and without the (60 s) backoff, and the
    server applies it once."""
    async with ClosingServer(rst=rst).running() as server:
        pool = PostConnections()
        first, second = poster(server.url, pool), poster(server.url, pool)
        try:
            assert await first.post({"n": 1}) == 1.0
            await first.close()  # a later step's client, over the same pool
            assert await asyncio.wait_for(second.post({"n": 2}), DEADLINE_S) == 1.0
        finally:
            await second.close()
            await pool.close()
    assert server.dropped == 1 and server.connections == 2
    assert server.handled == [{"n": 1}, {"n": 2}], "applied once: the dead connection was never read"


async def test_a_connection_the_post_opened_and_the_server_dropped_is_a_failed_attempt() -> None:
    """Not the pool's artefact: the server read the request and died. That attempt counts (no
    retries here: the post fails, naming the disconnect), so a server that always dies is not
    hammered beyond `max_retries`."""
    async with ClosingServer(drop_first=True).running() as server:
        pool = PostConnections()
        client = poster(server.url, pool)
        try:
            with pytest.raises(ValueError, match="after 1 attempts"):
                await asyncio.wait_for(client.post({"n": 1}), DEADLINE_S)
        finally:
            await client.close()
            await pool.close()
    assert server.handled == [{"n": 1}] and server.connections == 1


async def test_a_stale_connection_met_on_a_retry_is_resent_without_a_second_backoff() -> None:
    """The first attempt gets a 503 on a new connection (kept alive); the retry, one backoff later,
    reuses it as the server closes it, and is sent again at once: one backoff in all (2 s), not a
    second doubled one (4 s more, past the deadline)."""
    async with ClosingServer(busy_first=True).running() as server:
        pool = PostConnections()
        client = poster(server.url, pool, max_retries=1, backoff_s=2.0)
        try:
            assert await asyncio.wait_for(client.post({"n": 1}), DEADLINE_S) == 1.0
        finally:
            await client.close()
            await pool.close()
    assert server.handled == [{"n": 1}, {"n": 1}], "the 503 attempt, then the re-sent retry"
    assert server.dropped == 1 and server.connections == 2
