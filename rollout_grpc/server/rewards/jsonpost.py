"""One bounded JSON POST client for the servers a caller names: reward models, remote filters and
episode environments.

A step's caller picks the URL (within the operator's allowlist), so what such a server can do to the
replica is bounded here, once, for all of them (docs/security.md "Reward servers", "Environments"):
requests are bounded in number (`max_concurrency`), each attempt has a timeout, and what can succeed
on a second try (connection failures, timeouts, 429 and 5xx) is retried with exponential backoff; a
reply is read up to `max_reply_bytes` and no further, a probe answer up to `MAX_PROBE_BYTES`;
redirects are never followed (a redirect would send the payload to a host outside the allowlist);
an error body is quoted in a failure reason up to `MAX_BODY_EXCERPT` bytes. A failure is a
`ValueError` with its reason, for the caller to turn into its own per-sample outcome.

A pooled keep-alive connection the server closed (servers close idle ones on their own clock,
often sooner than the pool's `KEEPALIVE_S`) is not the server failing: a POST that reused one and
lost it before any answer is sent again at once, once per POST, on a new connection, outside
`max_retries` and without backoff (`_send`). Retries are at least once: every server POSTed to
here is idempotent by contract (a reward is a score; an environment answers a repeated
`(episode_id, turn)` the same way, docs/episodes.md); an idle close reads nothing, so that one
re-send is applied once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Protocol

import aiohttp

from rollout_grpc.server.rewards.connections import PostConnections

#: Seconds the start-of-step probe may take.
PROBE_TIMEOUT_S = 5.0
#: Bytes of a probe answer read at most (any answer proves the URL reachable; the rest is unread).
MAX_PROBE_BYTES = 64 << 10
#: Bytes of an error answer's body quoted in a failure reason.
MAX_BODY_EXCERPT = 128


class _Retryable(Exception):
    """An attempt failed in a way another attempt may not."""


class _Stale(Exception):
    """A POST went out on a pooled connection the server had closed; nothing was answered."""


class _Attempt:
    """One attempt's connection, as the session's trace hook saw it."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        #: The connection came from the pool (kept alive from an earlier request).
        self.reused = False


async def _on_reuse(
    session: aiohttp.ClientSession,
    context: SimpleNamespace,
    params: aiohttp.TraceConnectionReuseconnParams,
) -> None:
    attempt = context.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.reused = True


def trace() -> aiohttp.TraceConfig:
    """The trace hook that marks an attempt whose connection came from the pool."""
    config = aiohttp.TraceConfig()
    config.on_connection_reuseconn.append(_on_reuse)
    return config


#: How a connection that died unanswered looks: the server closed it (FIN) or reset it.
_DEAD_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def excerpt(body: bytes) -> str:
    """The start of an error body for a failure reason (bounded, escaped)."""
    more = "..." if len(body) > MAX_BODY_EXCERPT else ""
    return f"{body[:MAX_BODY_EXCERPT]!r}{more}"


async def read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The body, or None once it is over `cap` bytes (reading stops there; the connection is
    closed rather than drained)."""
    if response.content_length is not None and response.content_length > cap:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 << 10):
        body += chunk
        if len(body) > cap:
            return None
    return bytes(body)


class PostConfig(Protocol):
    """What a caller's spec says of its server (a reward, a remote filter, an environment)."""

    @property
    def url(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def max_retries(self) -> int: ...
    @property
    def backoff_s(self) -> float: ...
    @property
    def max_concurrency(self) -> int: ...


class JsonPoster:
    """POSTs JSON to one URL under the bounds above; one aiohttp session, made on first use.

    `what` names the URL's role in failure reasons ("reward", "environment": "the reward URL must
    answer itself"). With `connections` (the replica's pool, connections.py) the session's
    connections are the pool's, kept warm across steps; without, the session has its own.
    """

    def __init__(
        self,
        url: str,
        *,
        what: str,
        timeout_s: float,
        max_retries: int,
        backoff_s: float,
        max_concurrency: int,
        max_reply_bytes: int,
        connections: PostConnections | None = None,
    ) -> None:
        self.url = url
        self._connections = connections
        self._what = what
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._backoff_s = backoff_s
        self._max_reply_bytes = max_reply_bytes
        self._limit = asyncio.Semaphore(max_concurrency)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def of(
        cls,
        config: PostConfig,
        *,
        what: str,
        max_reply_bytes: int,
        connections: PostConnections | None = None,
    ) -> JsonPoster:
        """The client for a spec's server (over the replica's pool when `connections` is given)."""
        return cls(
            config.url,
            what=what,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            backoff_s=config.backoff_s,
            max_concurrency=config.max_concurrency,
            max_reply_bytes=max_reply_bytes,
            connections=connections,
        )

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None and self._connections is not None:
            self._session = self._connections.session(self._timeout_s, trace_configs=[trace()])
        elif self._session is None:
            # trust_env stays off: a server on the cluster network is never reached through a proxy
            # configured for the outside world.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout_s), trace_configs=[trace()]
            )
        return self._session

    def _redirect(self, status: int) -> str | None:
        if 300 <= status < 400:
            return f"HTTP {status}: redirects are not followed (the {self._what} URL must answer itself)"
        return None

    async def probe(self) -> str | None:
        """Why the URL is not usable, or None: any HTTP answer but a redirect proves it reachable
        (the server may refuse GET)."""
        try:
            async with self._http().get(
                self.url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S), allow_redirects=False
            ) as response:
                await read_capped(response, MAX_PROBE_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"does not answer: {exc!r}"
        return self._redirect(response.status)

    async def post(self, payload: Mapping[str, object]) -> object:
        """One POST with retries: the decoded JSON answer, or ValueError with the reason."""
        delay = self._backoff_s
        last = ""
        resent = False
        resend_now = False
        attempt = 0
        while attempt <= self._max_retries:
            if attempt and not resend_now:
                await asyncio.sleep(delay)  # backoff between attempts, not synchronisation
                delay *= 2
            resend_now = False
            try:
                async with self._limit:
                    response = await self._send(payload, resend=not resent)
                    async with response:
                        return await self._read(response)
            except _Stale:
                resent = resend_now = True
                continue  # the same attempt again at once, on a new connection
            except (_Retryable, aiohttp.ClientError, TimeoutError) as exc:
                last = str(exc) or type(exc).__name__
            attempt += 1
        raise ValueError(f"{last} after {self._max_retries + 1} attempts")

    async def _send(self, payload: Mapping[str, object], *, resend: bool) -> aiohttp.ClientResponse:
        """Send the POST and wait for the answer's head. `_Stale` when it went out on a pooled
        connection that died before any answer and this POST has not been re-sent yet: the
        server's idle close, which the pool could not see in time."""
        attempt = _Attempt()
        try:
            return await self._http().post(
                self.url, json=payload, allow_redirects=False, trace_request_ctx=attempt
            )
        except _DEAD_CONNECTION as exc:
            if resend and attempt.reused:
                raise _Stale from exc
            raise

    async def _read(self, response: aiohttp.ClientResponse) -> object:
        """One attempt's answer; `_Retryable` when another attempt may succeed."""
        redirect = self._redirect(response.status)
        if redirect is not None:
            raise ValueError(redirect)
        cap = self._max_reply_bytes
        body = await read_capped(response, cap)
        if body is None:
            raise ValueError(
                f"HTTP {response.status}: the answer is over the {cap} byte cap (reading stopped there)"
            )
        if response.status == 429 or response.status >= 500:
            raise _Retryable(f"HTTP {response.status}")
        if response.status >= 400:
            raise ValueError(f"HTTP {response.status}: {excerpt(body)}")
        try:
            return json.loads(body)
        except ValueError:
            raise ValueError(f"the answer is not JSON: {excerpt(body)}") from None

    async def close(self) -> None:
        """Close the session (a pooled one leaves its connections in the pool)."""
        if self._session is not None:
            await self._session.close()
