"""One vLLM engine over HTTP: generate (SSE), abort, pause/resume, weights, render, health, info.

This module knows the vLLM 0.32 HTTP surface (`docs/vllm-http-api.md`) and nothing about
protobuf or rollout semantics. Every call goes through one shared `aiohttp.ClientSession`, owned by
the caller, so connection pooling and the connector limit are decided once per process.

Errors are reported with three exception types so that callers can decide what is retryable:
`EngineHTTPError` (the engine answered with an error status: deterministic, do not retry),
`EngineUnavailable` (no answer, connection refused or broken mid-stream: try another engine) and
`EngineStreamError` (the engine reported an error inside a 200 SSE stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, Final

import aiohttp
import orjson

#: vLLM tracks a generate call as this prefix + the request id; abort matches only the prefixed id.
ENGINE_ID_PREFIX: Final = "generate-tokens-"

_JSON_HEADERS: Final = {"Content-Type": "application/json"}
_DATA: Final = b"data: "
_DONE: Final = b"[DONE]"
#: aiohttp failures that mean "no (complete) answer from this engine": try another one.
_TRANSPORT_ERRORS: Final = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


def engine_request_id(request_id: str) -> str:
    """The id vLLM uses internally (and for aborts) for a generate call sent with `request_id`."""
    return ENGINE_ID_PREFIX + request_id


class EngineError(Exception):
    """Base class of engine failures; `url` names the engine."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url
        self.message = message


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error; `param` is vLLM's field name when it gave one."""

    def __init__(
        self, url: str, status: int, message: str, error_type: str = "", param: str | None = None
    ) -> None:
        super().__init__(url, message)
        self.status = status
        self.error_type = error_type
        self.param = param


class EngineUnavailable(EngineError):
    """The engine could not be reached, or the connection broke before the reply was complete."""


class EngineStreamError(EngineError):
    """The engine sent an error event inside an SSE stream (HTTP status stays 200 in vLLM)."""


@dataclass(frozen=True, slots=True)
class EngineTimeouts:
    """Timeouts for engine calls.

    `sock_read` bounds the silence between two SSE events, not the whole generation: generations
    may legitimately take hours, and vLLM holds requests while paused, so there is no total limit
    unless the gRPC caller set a deadline.
    """

    connect: float = 5.0
    sock_read: float | None = None
    control: float = 30.0


def _error_from_body(url: str, status: int, body: bytes) -> EngineHTTPError:
    """Parse vLLM's error envelopes (`{"error":{message,type,param,code}}` or `{"error":"..."}`)."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            return EngineHTTPError(
                url,
                status,
                str(error.get("message", "")),
                str(error.get("type", "")),
                error.get("param") if isinstance(error.get("param"), str) else None,
            )
        if isinstance(error, str):
            return EngineHTTPError(url, status, error)
    text = body.decode("utf-8", "replace")[:500] if body else f"HTTP {status}"
    return EngineHTTPError(url, status, text)


class VllmEngine:
    """HTTP client for one vLLM engine (or the simulator, which speaks the same surface)."""

    def __init__(
        self, url: str, session: aiohttp.ClientSession, timeouts: EngineTimeouts | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._timeouts = timeouts or EngineTimeouts()

    # ----------------------------------------------------------------------------- generation

    async def generate_stream(
        self, body: Mapping[str, Any], *, total_timeout: float | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """POST /inference/v1/generate with `stream: true` and yield each parsed SSE chunk.

        Leaving the iteration early (an exception, `aclose()`, task cancellation) closes the HTTP
        connection instead of returning it to the pool; vLLM aborts a request whose client
        disconnected, so the engine stops generating.
        """
        timeout = aiohttp.ClientTimeout(
            total=total_timeout, sock_connect=self._timeouts.connect, sock_read=self._timeouts.sock_read
        )
        payload = orjson.dumps({**body, "stream": True})
        url = self.url + "/inference/v1/generate"
        try:
            async with self._session.post(url, data=payload, headers=_JSON_HEADERS, timeout=timeout) as resp:
                if resp.status != 200:
                    raise _error_from_body(self.url, resp.status, await resp.read())
                finished = False
                async for line in resp.content:
                    if not line.startswith(_DATA):
                        continue
                    data = line[6:].strip()
                    if data == _DONE:
                        finished = True
                        break
                    chunk = orjson.loads(data)
                    error = chunk.get("error")
                    if error is not None:
                        message = error.get("message") if isinstance(error, dict) else str(error)
                        raise EngineStreamError(self.url, str(message))
                    yield chunk
                if not finished:
                    raise EngineUnavailable(self.url, "the engine closed the stream before [DONE]")
        except _TRANSPORT_ERRORS as exc:
            raise EngineUnavailable(self.url, f"{type(exc).__name__}: {exc}") from exc

    # ----------------------------------------------------------------------------- control

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> tuple[int, bytes]:
        """One control call; returns (status, body). Connection failures raise EngineUnavailable.

        `timeout` defaults (`...`) to the control timeout; None means no limit (`/pause?mode=wait`
        returns only when the engine has drained).
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
                headers=_JSON_HEADERS if data is not None else None,
                timeout=client_timeout,
            ) as resp:
                return resp.status, await resp.read()
        except _TRANSPORT_ERRORS as exc:
            raise EngineUnavailable(self.url, f"{type(exc).__name__}: {exc}") from exc

    async def _json(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> Any:
        status, body = await self._request(method, path, json_body=json_body, params=params, timeout=timeout)
        if status != 200:
            raise _error_from_body(self.url, status, body)
        return orjson.loads(body) if body else None

    async def health(self, timeout: float = 2.0) -> bool:
        """GET /health: True on 200. A refused connection or a 503 (dead engine) is False."""
        try:
            status, _ = await self._request("GET", "/health", timeout=timeout)
        except EngineUnavailable:
            return False
        return status == 200

    async def abort_requests(self, request_ids: list[str]) -> None:
        """POST /inference/v1/abort_requests with engine ids (`generate-tokens-...`)."""
        await self._json("POST", "/inference/v1/abort_requests", json_body={"request_ids": request_ids})

    async def pause(self, mode: str, timeout: float | EllipsisType | None = ...) -> None:
        """POST /pause?mode=abort|wait|keep. `wait` blocks until in-flight requests have finished."""
        await self._json("POST", "/pause", params={"mode": mode}, json_body={}, timeout=timeout)

    async def resume(self) -> None:
        """POST /resume (idempotent)."""
        await self._json("POST", "/resume", json_body={})

    async def is_paused(self) -> bool:
        """GET /is_paused."""
        body = await self._json("GET", "/is_paused")
        return bool(body.get("is_paused")) if isinstance(body, dict) else False

    async def update_weight_version(self, version: str) -> None:
        """POST /update_weight_version: later output tokens are labelled `version`."""
        await self._json("POST", "/update_weight_version", json_body={"new_version": version})

    async def weight_version(self) -> str:
        """GET /weight_info."""
        body = await self._json("GET", "/weight_info")
        return str(body.get("weight_version", "")) if isinstance(body, dict) else ""

    async def models(self) -> list[dict[str, Any]]:
        """GET /v1/models: the served models with `id` and `max_model_len`."""
        body = await self._json("GET", "/v1/models")
        data = body.get("data", []) if isinstance(body, dict) else []
        return [m for m in data if isinstance(m, dict)]

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info?config_format=json (development router): the engine's configuration."""
        body = await self._json("GET", "/server_info", params={"config_format": "json"})
        return body if isinstance(body, dict) else {}

    async def render_chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/chat/completions/render: a GenerateRequest body with expanded placeholders."""
        result = await self._json("POST", "/v1/chat/completions/render", json_body=dict(body))
        if not isinstance(result, dict):
            raise EngineHTTPError(self.url, 200, "chat render returned no object")
        return result

    async def render_completion(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """POST /v1/completions/render: a list of GenerateRequest bodies, one per prompt."""
        result = await self._json("POST", "/v1/completions/render", json_body=dict(body))
        if not isinstance(result, list):
            raise EngineHTTPError(self.url, 200, "completions render returned no list")
        return [r for r in result if isinstance(r, dict)]
