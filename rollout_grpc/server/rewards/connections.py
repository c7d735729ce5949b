"""One keep-alive connection pool per replica process for the servers steps POST to: reward models,
remote filters and episode environments (`jsonpost.JsonPoster`).

Why: a step that made its own aiohttp connector opened a fresh TCP (and TLS) connection for each
of its first `max_concurrency` reward requests, all inside the burst where a batch of samples ends
at once, and built an SSL context per step; the next step threw those connections away and did it
again (bench/profile_notes.md, tenth pass: the reward client was the difference between the step
and slime's hand loop). One pool per replica keeps them warm across steps.

What is shared is only the pool of idle connections. Each step still makes its own
`aiohttp.ClientSession` over it (`session`), so its timeout and its cookie jar stay its own: a
cookie one caller's reward server sets never travels with another caller's request. Each step's
`max_concurrency` still bounds its requests (JsonPoster's semaphore); the pool's own bound,
`MAX_CONNECTIONS`, only caps the sockets a replica holds to these servers.
"""

from __future__ import annotations

import aiohttp

#: Sockets the replica holds to reward, filter and environment servers at most (open at once,
#: idle or busy). Well above one step's share (`max_concurrency`, 32 by default), so steps of
#: different callers do not wait on each other for a connection in practice.
MAX_CONNECTIONS = 1024
#: Seconds an idle connection is kept for the next request (aiohttp's default, 15 s, covers the
#: gap between the samples of a step and between back-to-back steps). A server that closes sooner
#: usually has its close seen first and the connection dropped from the pool; a POST that reuses
#: it as it closes is sent again at once by JsonPoster, outside the caller's retries.
KEEPALIVE_S = 15.0


class PostConnections:
    """The replica's pool of keep-alive connections (made on first use, on the running loop)."""

    def __init__(self, limit: int = MAX_CONNECTIONS, keepalive_s: float = KEEPALIVE_S) -> None:
        self._limit = limit
        self._keepalive_s = keepalive_s
        self._connector: aiohttp.TCPConnector | None = None

    def session(
        self, timeout_s: float, *, trace_configs: list[aiohttp.TraceConfig] | None = None
    ) -> aiohttp.ClientSession:
        """A session of one step's client over the shared pool; closing it leaves the pool open.
        `trace_configs`: the client's hooks (JsonPoster's tells a reused connection from a new one).

        trust_env stays off: a server on the cluster network is never reached through a proxy
        configured for the outside world.
        """
        if self._connector is None or self._connector.closed:
            self._connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=self._keepalive_s)
        return aiohttp.ClientSession(
            connector=self._connector,
            connector_owner=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            trace_configs=trace_configs,
        )

    async def close(self) -> None:
        """Close every pooled connection (the replica's shutdown)."""
        if self._connector is not None:
            await self._connector.close()
            self._connector = None
