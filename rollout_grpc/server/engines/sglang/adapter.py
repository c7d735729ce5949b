"""The SGLang engine adapter: `/generate` (SSE), abort, pause/continue, weight versions, health, info.

The only server module (with its siblings `wire`, `stream`, `experts`, `info`) that knows SGLang's
HTTP surface, as read from SGLang's source at the commits of docs/sglang-http-api.md — verified
against that reading and the simulator (`rollout_grpc/sim/sglang/`), not against a running SGLang.
The transport (one shared session, SSE splitting, the idle probe) is `engines/http.HttpEngine`.

How the domain's operations map (docs/engines.md has the side-by-side table):

* abort by id: `POST /abort_request {"rid"}` per engine rid (rids are prefix-free, `wire`);
  abort-all is the domain's pause(abort) + resume: `/pause_generation {"mode": "abort"}` then
  `/continue_generation`. Aborted calls end normally with every token (`finish_reason.type` abort).
* pause modes: `abort` -> `abort`, `keep` -> `in_place` (KV kept, resumes exactly). `wait` has no
  SGLang mode (each of SGLang's freezes or aborts running requests), so it is emulated: this
  adapter holds its new calls, polls `/v1/loads` until nothing runs or waits, then pauses
  `in_place` (which holds everyone's new calls until continue). Other clients' calls that arrive
  during the drain are not held by that emulation.
* `is_paused`: SGLang has no route that reports a pause, so this is what this adapter last did.
* `/update_weight_version` aborts every request in flight unless told not to: it is always sent
  with `abort_all_requests: false` (the domain relabels, it never aborts by relabelling).
* render: SGLang has no render route (the doc lists none): FAILED_PRECONDITION, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import EllipsisType
from typing import Final

import aiohttp
import orjson

from rollout_grpc.server.domain.errors import FailedPrecondition
from rollout_grpc.server.engines.api import (
    ChatRenderRequest,
    ControlAction,
    EngineCall,
    EngineCapabilities,
    EngineError,
    EngineEvent,
    EngineFinal,
    EngineHealth,
    EngineMalformed,
    EngineTimeouts,
    EngineUnavailable,
    Rendered,
    ServedModel,
)
from rollout_grpc.server.engines.http import DONE, TRANSPORT_ERRORS, HttpEngine
from rollout_grpc.server.engines.sglang import info, wire
from rollout_grpc.server.engines.sglang.stream import ChunkReader
from rollout_grpc.server.engines.sglang.weights import SglangWeights

#: The route behind each fleet-control operation (for messages that name the failed call).
CONTROL_ROUTES: Final[dict[ControlAction, str]] = {
    ControlAction.PAUSE: "/pause_generation",
    ControlAction.RESUME: "/continue_generation",
    ControlAction.ABORT: "/abort_request",
    ControlAction.UPDATE_WEIGHT_VERSION: "/update_weight_version",
}
#: The domain's pause modes -> SGLang's (`wait` is emulated, see the module docstring).
PAUSE_MODES: Final = {"abort": "abort", "keep": "in_place", "wait": "in_place"}
MISSING_ROUTE_HINT: Final = (
    "not served by this SGLang build: check that the engine is SGLang (not vLLM behind a sglang+ URL) "
    "and recent enough (docs/sglang-http-api.md names the commit these routes were read at)"
)
#: Polling of `/v1/loads` while emulating a `wait` pause: first and longest interval (seconds).
_DRAIN_POLL_S: Final = (0.02, 0.5)
_PARSE_ERRORS: Final = (KeyError, TypeError, ValueError, AttributeError, IndexError)


class SglangEngine(HttpEngine, SglangWeights):
    """One SGLang engine (or the simulator's SGLang personality): an `EngineAdapter`."""

    kind = "sglang"
    generate_path = "/generate"
    missing_route_hint = MISSING_ROUTE_HINT

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        timeouts: EngineTimeouts | None = None,
        *,
        experts_topk: int | None = None,
    ) -> None:
        super().__init__(url, session, timeouts)
        #: The model's `num_experts_per_tok`, which shapes SGLang's raw routing bytes (R3).
        self.experts_topk = experts_topk
        self._paused = False
        #: Cleared while a `wait` pause drains the engine: this adapter's new calls wait on it.
        self._open = asyncio.Event()
        self._open.set()

    def control_route(self, action: ControlAction) -> str:
        return CONTROL_ROUTES[action]

    def engine_request_id(self, call_id: str) -> str:
        """See `wire.engine_request_id`."""
        return wire.engine_request_id(call_id)

    def _http_error(self, status: int, body: bytes) -> EngineError:
        return wire.http_error(self.url, status, body)

    # ----------------------------------------------------------------------------- generation

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineEvent]:
        """POST /generate (SSE) and yield neutral events; see `EngineAdapter.generate`.

        Leaving early closes the connection; SGLang aborts a request whose stream ended (2 s
        later, `create_abort_task`), and the rid of a failover call differs, so nothing collides.
        """
        body = wire.generate_body(self.url, call)
        await self._open.wait()
        reader = ChunkReader(self.url, call, self.experts_topk)
        finished = False
        try:
            async with contextlib.AsyncExitStack() as stack:
                resp = await self._open_stream(stack, body)
                if resp.status != 200:
                    raise self._http_error(resp.status, await resp.read())
                # Closed here, not by the garbage collector (a finalizer task per call).
                async with contextlib.aclosing(self._events(resp)) as events:
                    async for data in events:
                        if data == DONE:
                            return
                        for event in self._parse(reader, data):
                            finished = finished or isinstance(event, EngineFinal)
                            yield event
                if not finished:
                    raise EngineUnavailable(self.url, "the engine closed the stream before [DONE]")
        except TRANSPORT_ERRORS as exc:
            if finished:  # the final output arrived; only [DONE] was lost
                return
            raise EngineUnavailable(self.url, f"{type(exc).__name__}: {exc}") from exc

    def _parse(self, reader: ChunkReader, data: bytes) -> list[EngineEvent]:
        """One SSE payload, taken whole or not at all."""
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise EngineMalformed(self.url, f"invalid JSON in the stream: {exc}") from None
        try:
            return reader.read(chunk)
        except EngineError:
            raise
        except _PARSE_ERRORS as exc:
            raise EngineMalformed(self.url, f"unusable stream chunk: {exc}") from None

    # ----------------------------------------------------------------------------- control

    async def health(self, timeout: float = 2.0) -> EngineHealth:
        """GET /health: 200 at once on a live SGLang, 503 while starting or shutting down.

        Not `/health_generate`: it runs a one-token generation (up to 20 s), too slow for a
        liveness probe that must answer within seconds.
        """
        return await self._probe_health("/health", "an SGLang server", timeout)

    async def abort_requests(self, engine_request_ids: list[str]) -> None:
        """POST /abort_request {"rid"} for each engine rid (SGLang takes one rid per call)."""
        await asyncio.gather(
            *(self._json("POST", "/abort_request", json_body={"rid": rid}) for rid in engine_request_ids)
        )

    async def pause(self, mode: str, timeout: float | EllipsisType | None = ...) -> None:
        """POST /pause_generation in SGLang's mode for `mode` (`wait` drains first, emulated)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}")
        try:
            if mode == "wait":
                self._open.clear()
                await self._drain(None if timeout is ... else timeout)
            await self._json(
                "POST", "/pause_generation", json_body={"mode": PAUSE_MODES[mode]}, timeout=timeout
            )
        except BaseException:
            self._open.set()
            raise
        self._paused = True

    async def _drain(self, timeout: float | None) -> None:
        """Poll `/v1/loads` until the engine runs and queues nothing (within `timeout`)."""
        interval, longest = _DRAIN_POLL_S
        async with asyncio.timeout(timeout):
            while await self._load():
                await asyncio.sleep(interval)
                interval = min(2 * interval, longest)

    async def _load(self) -> int:
        """Requests running plus waiting on every DP rank of `/v1/loads`."""
        body = await self._json("GET", "/v1/loads", params={"include": "core"})
        loads = body.get("loads") if isinstance(body, dict) else body
        if not isinstance(loads, list):
            raise EngineMalformed(self.url, "/v1/loads answered no list of loads")
        total = 0
        for load in loads:
            if isinstance(load, dict):
                for key in ("num_running_reqs", "num_waiting_reqs"):
                    value = load.get(key)
                    total += value if type(value) is int else 0
        return total

    async def resume(self) -> None:
        """POST /continue_generation (idempotent); this adapter's held calls go on too."""
        await self._json("POST", "/continue_generation", json_body={})
        self._paused = False
        self._open.set()

    async def is_paused(self) -> bool:
        """SGLang reports no pause state: whether this adapter paused it last (not another client)."""
        return self._paused

    async def update_weight_version(self, version: str) -> None:
        """POST /update_weight_version without aborting anything (its default aborts all)."""
        await self._json(
            "POST",
            "/update_weight_version",
            json_body={"new_version": version, "abort_all_requests": False},
        )

    async def weight_version(self) -> str:
        """GET /model_info's `weight_version` (`/get_weight_version` is a 404 in newer builds)."""
        body = await self._json("GET", "/model_info")
        return str(body.get("weight_version") or "") if isinstance(body, dict) else ""

    async def models(self) -> list[ServedModel]:
        """GET /v1/models: `data[]` cards with `id`, `max_model_len` and `created`."""
        body = await self._json("GET", "/v1/models")
        data = body.get("data", []) if isinstance(body, dict) else []
        return [
            ServedModel(
                id=str(m.get("id", "")),
                max_model_len=m.get("max_model_len") if type(m.get("max_model_len")) is int else None,
                created=m.get("created") if type(m.get("created")) is int else None,
            )
            for m in data
            if isinstance(m, dict)
        ]

    async def capabilities(self, raw_logprobs: str) -> EngineCapabilities:
        """`info.check`. `raw_logprobs` does not apply: SGLang has no logprobs-mode setting to
        check (whether its logprobs reflect temperature is unverified, docs/sglang-http-api.md)."""
        return await info.check(self)

    # ----------------------------------------------------------------------------- render

    def _no_render(self) -> FailedPrecondition:
        return FailedPrecondition(
            f"engine {self.url} is SGLang, which serves no render route: render on a vLLM engine, or "
            "send token ids (images go to SGLang as image URLs in the sample's media items)"
        )

    async def render_text(self, text: str, model: str = "") -> Rendered:
        raise self._no_render()

    async def render_chat(self, request: ChatRenderRequest) -> Rendered:
        raise self._no_render()
