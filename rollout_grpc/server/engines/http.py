"""What every HTTP engine adapter shares: one session, SSE line splitting, the idle watch, control
calls and the health probe with its cause.

Both engine kinds (`engines/vllm/`, `engines/sglang/`) speak JSON over HTTP and stream SSE; the
transport rules are the same for both and are written once here, so that a fix to the idle check
or to the line splitter reaches every kind:

* **Huge SSE lines.** A final chunk carries R3 routing for the whole sequence in one line (~512
  bytes per token at 48 layers x top-8: 16 MB at 32k tokens). Lines are split here, bounded by
  `EngineTimeouts.max_event_bytes`, not by aiohttp's 512 KiB line reader.
* **Silence is probed, not timed out.** A generation may legitimately be silent (paused engine,
  long prefill); after `EngineTimeouts.idle` seconds without a byte the engine's health route is
  asked, and only an engine that does not answer is `EngineHung`.

Nothing here knows an engine's paths, JSON keys or error envelopes: a subclass names its health
route, its generate route and how an HTTP error body maps to a neutral error (`_http_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import orjson
import structlog

from rollout_grpc.server.engines.api import (
    HEALTHY,
    EngineError,
    EngineHealth,
    EngineHung,
    EngineMalformed,
    EngineTimeouts,
    EngineUnavailable,
    describe_transport_error,
)

JSON_HEADERS: Final = {"Content-Type": "application/json"}
DATA: Final = b"data: "
DONE: Final = b"[DONE]"
#: aiohttp failures that mean "no (complete) answer from this engine": try another one.
TRANSPORT_ERRORS: Final = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
#: How much later than twice its timeout a probe may time out before the event loop, not the
#: engine, is taken to have timed it (`_probe_health`).
_LOOP_STALL_SLACK_S: Final = 1.0

log = structlog.get_logger(__name__)


_SPACE: Final = frozenset(b" \t\r\n\x0b\x0c")


def take_events(buf: bytearray, scan: int) -> tuple[list[bytes], int]:
    """The `data:` payloads of the complete lines at the front of `buf`, which are removed from it,
    and where the next search for a line end starts (lines are not split by length).

    Each payload is copied out of `buf` once, its surrounding whitespace trimmed by index: three
    copies of a 250 MiB event (slice, bytes, strip) held the replica's event loop 4-7 s, long
    enough for every other stream and the health probes to stall.
    """
    events: list[bytes] = []
    start = 0
    while (end := buf.find(b"\n", scan)) >= 0:
        first, last = start, end
        start = scan = end + 1
        if not buf.startswith(DATA, first, last):
            continue
        first += len(DATA)
        while first < last and buf[first] in _SPACE:
            first += 1
        while last > first and buf[last - 1] in _SPACE:
            last -= 1
        with memoryview(buf) as view, view[first:last] as payload:
            events.append(bytes(payload))
    if start:
        del buf[:start]
    return events, len(buf)


def received_before_the_break(content: aiohttp.StreamReader) -> bytes:
    """What a body whose connection broke had received but not yet handed out; it is taken.

    Why: aiohttp's `StreamReader.readany` (3.14) raises the error that the connection's end set
    *before* returning data already buffered. When an engine's last chunk and its connection's end
    are processed in one event-loop turn (a busy replica, an engine that dies right after a
    write), that chunk — tokens the engine made and sent — was discarded, and the next engine had
    to make them again. aiohttp has no public call for the buffer, so this reads its `_buffer`
    (a deque of bytes, consumed from `_buffer_offset`); if a later aiohttp changes that, nothing
    is salvaged (never a wrong byte), and tests/unit/test_engines.py fails to say so.
    """
    buffer = getattr(content, "_buffer", None)
    if not buffer or not all(isinstance(piece, bytes) for piece in buffer):
        return b""
    offset = getattr(content, "_buffer_offset", 0)
    data = b"".join(buffer)[offset if isinstance(offset, int) else 0 :]
    buffer.clear()
    if isinstance(offset, int):
        content._buffer_offset = 0
    return data


class IdleWatch:
    """Notices a read of an engine stream that has waited `idle` seconds, and interrupts it.

    One timer per idle period, not one per read: an `asyncio.timeout` around every SSE read cost
    the service ~2 s of CPU per million streamed tokens at 512 streams (bench.compare A/B). Only a
    read in progress is interrupted (never the consumer's own awaits between reads), by cancelling
    the reading task; `interrupted()` tells that cancellation apart from anyone else's.
    """

    __slots__ = ("_base", "_fired", "_handle", "_idle", "_loop", "_since", "_task")

    def __init__(self, idle: float) -> None:
        self._idle = idle
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("an engine stream is read outside a task")
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self._since: float | None = None
        self._base = 0
        self._fired = False

    def arm(self) -> None:
        """A read starts."""
        self._since = self._loop.time()
        self._base = self._task.cancelling()
        if self._handle is None:
            self._handle = self._loop.call_at(self._since + self._idle, self._check)

    def disarm(self) -> None:
        """The read ended (the timer stays; it re-arms itself only while a read is waiting)."""
        self._since = None

    def _check(self) -> None:
        self._handle = None
        if self._since is None:
            return
        due = self._since + self._idle
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._fired = True
        self._task.cancel()

    def interrupted(self) -> bool:
        """After a CancelledError in a read: True when it was this watch's alone (then absorbed)."""
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() <= self._base

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class HttpEngineMixin:
    """What a mixin of an `HttpEngine` subclass (an engine kind's weight operations, say) uses of
    it, declared once for the type checker; the engine class supplies both at run time."""

    url: str

    if TYPE_CHECKING:

        async def _json(
            self,
            method: str,
            path: str,
            *,
            json_body: Any = None,
            params: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
            timeout: float | EllipsisType | None = ...,
        ) -> Any: ...


class HttpEngine:
    """The transport half of an HTTP engine adapter; a kind's adapter subclasses it.

    A subclass sets `generate_path` and implements `_http_error` (its error envelopes).
    """

    #: The route `_open_stream` posts a generate body to.
    generate_path: str = ""

    def __init__(
        self, url: str, session: aiohttp.ClientSession, timeouts: EngineTimeouts | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._timeouts = timeouts or EngineTimeouts()

    def _http_error(self, status: int, body: bytes) -> EngineError:
        """An HTTP error status of this engine kind as a neutral engine error."""
        raise NotImplementedError

    async def health(self, timeout: float = 2.0) -> EngineHealth:
        """The kind's liveness probe (`_probe_health` on its health route)."""
        raise NotImplementedError

    async def _probe_health(self, path: str, kind: str, timeout: float) -> EngineHealth:
        """GET `path`: healthy on 200. A refused connection, silence, a 503 (dead engine) or a
        server without that route (404/405: not `kind`, probably the wrong port) is unhealthy,
        with that cause in an operator's words.

        A probe that timed out long after its timeout was timed by a stalled event loop (this
        replica's: a long GC pause, a blocking call), not by the engine — after a stall the timer
        runs before the reply already in the socket is read. That verdict is worthless, and
        acting on it would fail over every silent stream on a live engine, so the probe is asked
        once more."""
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            started = loop.time()
            try:
                status, _ = await self._request("GET", path, timeout=timeout)
                break
            except EngineUnavailable as exc:
                cause = exc.__cause__
                late = loop.time() - started > 2 * timeout + _LOOP_STALL_SLACK_S
                if attempt == 1 and isinstance(cause, TimeoutError) and late:
                    log.warning("health_probe_timed_out_by_a_stalled_loop", engine=self.url, path=path)
                    continue
                return EngineHealth(False, describe_transport_error(cause, timeout) if cause else exc.message)
        if status == 200:
            return HEALTHY
        if status in (404, 405):
            return EngineHealth(False, f"answers HTTP {status} on {path}: not {kind} (wrong port?)")
        return EngineHealth(False, f"GET {path} answered HTTP {status}")

    async def _open_stream(
        self, stack: contextlib.AsyncExitStack, body: dict[str, Any]
    ) -> aiohttp.ClientResponse:
        """Send the request and wait for the response head, checking a silent engine's liveness."""
        timeout = aiohttp.ClientTimeout(
            sock_connect=self._timeouts.connect, sock_read=self._timeouts.sock_read
        )
        request = self._session.post(
            self.url + self.generate_path,
            data=orjson.dumps(body),
            headers=JSON_HEADERS,
            timeout=timeout,
        )
        task = asyncio.ensure_future(stack.enter_async_context(request))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self._timeouts.idle)
                if done:
                    return task.result()
                await self._check_alive()
        except BaseException:
            task.cancel()
            raise

    async def _check_alive(self) -> None:
        """After `idle` seconds of silence: keep waiting if the engine answers, else it is hung."""
        if not await self.health(self._timeouts.liveness):
            raise EngineHung(
                self.url,
                f"no data for {self._timeouts.idle:g} s and no answer to a liveness probe within "
                f"{self._timeouts.liveness:g} s",
            )

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncGenerator[list[bytes], None]:
        """The `data:` payloads of an SSE body, split without a line-length cap below the limit:
        one list per read of the body that completed any (never an empty one).

        A list per read, not a payload per resume: every streamed message passes through a chain
        of generators, and each resume of each is paid per item (bench/profile_notes.md, twelfth
        pass); the events of one read are handed on in one resume."""
        limit = self._timeouts.max_event_bytes
        buf = bytearray()
        scan = 0
        watch = IdleWatch(self._timeouts.idle) if self._timeouts.idle else None
        try:
            while piece := await self._read(resp, watch):
                buf += piece
                events, scan = take_events(buf, scan)
                if events:
                    yield events
                if len(buf) > limit:
                    raise EngineMalformed(self.url, f"a stream event exceeds {limit} bytes")
        finally:
            if watch is not None:
                watch.close()

    async def _read(self, resp: aiohttp.ClientResponse, watch: IdleWatch | None) -> bytes:
        """The body's next chunk (b"" at its end); a read silent for the idle time probes the engine."""
        while True:
            if watch is not None:
                watch.arm()
            try:
                return await resp.content.readany()
            except aiohttp.ClientPayloadError:
                if salvaged := received_before_the_break(resp.content):
                    return salvaged  # the error comes again at the next read
                raise
            except asyncio.CancelledError:
                if watch is None or not watch.interrupted():
                    raise
                await self._check_alive()  # silent for the idle time: hung, or only paused?
            finally:
                if watch is not None:
                    watch.disarm()

    # ----------------------------------------------------------------------------- control

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> tuple[int, bytes]:
        """One control call; returns (status, body). Connection failures raise EngineUnavailable.

        `timeout` defaults (`...`) to the control timeout; None means no limit (a pause that
        waits for the engine to drain).
        """
        client_timeout = aiohttp.ClientTimeout(
            total=self._timeouts.control if timeout is ... else timeout,
            sock_connect=self._timeouts.connect,
        )
        data = orjson.dumps(json_body) if json_body is not None else None
        try:
            async with self._session.request(
                method,
                self.url + path,
                data=data,
                params=params,
                headers=JSON_HEADERS if data is not None else None,
                timeout=client_timeout,
            ) as resp:
                return resp.status, await resp.read()
        except TRANSPORT_ERRORS as exc:
            raise EngineUnavailable(self.url, f"{type(exc).__name__}: {exc}") from exc

    async def _json(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> Any:
        status, body = await self._request(method, path, json_body=json_body, params=params, timeout=timeout)
        if status != 200:
            raise self._http_error(status, body)
        try:
            return orjson.loads(body) if body else None
        except orjson.JSONDecodeError as exc:
            raise EngineMalformed(self.url, f"{path} answered invalid JSON: {exc}") from None
