"""The SGLang engine adapter: `/generate` (SSE), abort, pause/continue, weight versions, health, info.

The only server module (with its siblings `wire`, `stream`, `experts`, `info`) that knows SGLang's
HTTP surface, as read from SGLang 0.5.23's released source (docs/sglang-http-api.md gives file and
line) — verified against that reading and the simulator (`rollout_grpc/sim/sglang/`); the device
check (`tools/sglang/device_check.sh`) runs it against a real SGLang where a GPU is present.
The transport (one shared session, SSE splitting, the idle probe) is `engines/http.HttpEngine`.

How the domain's operations map (docs/engines.md has the side-by-side table):

* abort by id: `POST /abort_request {"rid"}` per engine rid (rids are prefix-free, `wire`);
  abort-all is the domain's pause(abort) + resume. Aborted calls end normally with every token
  (`finish_reason.type` abort), including SGLang's waiting-queue abort echo (`stream`).
* pause modes: `abort` -> `abort`, `keep` -> `in_place` (KV kept, resumes exactly). `wait` has no
  SGLang mode (each of SGLang's freezes or aborts running requests), so it is emulated: poll
  `/v1/loads` until nothing runs or waits, then pause `in_place`.
* **An abort pause never follows an `in_place` pause directly.** SGLang's abort pause waits, under
  the lock `/continue_generation` also takes, until no request is in flight; a request frozen
  `in_place` never takes the forward pass that would end it, so the engine would be wedged until
  restarted (0.5.23 TM:2267-2286, SCH:2034, SB:2011). Over an `in_place` pause this adapter sends
  `/abort_request {"abort_all": true}` (the frozen requests are marked), `/continue_generation`
  (they take that pass and end ABORTED with their tokens), then `/pause_generation {"mode":
  "abort"}` (anything that started meanwhile), as `_abort_over_in_place` says.
* **This adapter holds its own new calls while it has the engine paused** (any mode), instead of
  letting SGLang hold them: SGLang registers a held call's rid before its pause gate, so an
  abort by rid of it is lost and marks the rid so every later abort of it is ignored (TM:926,
  938, 2241-2253). A held call aborted here (by rid, or by pause(abort)) ends at once, ABORTED
  with no tokens, without ever reaching the engine. Calls of other clients are still held by
  SGLang, and a call already on the wire when the pause lands can still be held there.
* `is_paused`: SGLang has no route that reports a pause, so this is what this adapter last did.
* `/update_weight_version` aborts every request in flight unless told not to: it is always sent
  with `abort_all_requests: false` (the domain relabels, it never aborts by relabelling).
* Each call is checked against `/server_info` (`info.ServerFacts`, read by `capabilities`): a
  seeded call on an engine without `--enable-deterministic-inference` is refused (SGLang would
  ignore the seed), and under `--raw-logprobs refuse` so is a truncating one (`info`).
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

from rollout_grpc.server.domain.chat import ChatRenderRequest, ServedModel
from rollout_grpc.server.domain.errors import FailedPrecondition
from rollout_grpc.server.domain.vocabulary import PauseMode
from rollout_grpc.server.engines.api import (
    ControlAction,
    EngineCall,
    EngineCapabilities,
    EngineError,
    EngineEvent,
    EngineFinal,
    EngineHealth,
    EngineMalformed,
    EngineRejected,
    EngineTimeouts,
    EngineUnavailable,
    EngineUsage,
    FinishKind,
    Rendered,
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
PAUSE_MODES: Final[dict[str, str]] = {
    PauseMode.ABORT: "abort",
    PauseMode.KEEP: "in_place",
    PauseMode.WAIT: "in_place",
}
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
        #: SGLang's pause mode this adapter last set (`in_place`, `abort`), None when running.
        self._engine_mode: str | None = None
        #: Cleared while this adapter pauses the engine: its new calls wait on it (held here).
        self._open = asyncio.Event()
        self._open.set()
        #: Engine rid -> set when the held call is aborted (it then ends without being sent).
        self._held: dict[str, asyncio.Event] = {}
        #: What `/server_info` said, for the per-call checks (None until `capabilities` ran).
        self._facts: info.ServerFacts | None = None

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
        body = wire.generate_body(self.url, call, self._facts.context_length if self._facts else None)
        self._check_call(call)
        if not self._open.is_set() and await self._held_then_aborted(wire.engine_request_id(call.call_id)):
            yield EngineUsage(len(call.prompt_token_ids), 0)
            yield EngineFinal(FinishKind.ABORT)
            return
        reader = ChunkReader(self.url, call, self.experts_topk)
        finished = False
        try:
            async with contextlib.AsyncExitStack() as stack:
                resp = await self._open_stream(stack, body)
                if resp.status != 200:
                    raise self._http_error(resp.status, await resp.read())
                # Closed here, not by the garbage collector (a finalizer task per call).
                async with contextlib.aclosing(self._events(resp)) as batches:
                    async for batch in batches:
                        for data in batch:
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

    def _check_call(self, call: EngineCall) -> None:
        """Refuse what this engine would silently change (`info.ServerFacts`)."""
        facts = self._facts
        if facts is None:
            return
        if call.sampling.seed is not None and facts.deterministic is False:
            raise EngineRejected(self.url, info.seed_refusal(self.url), "seed")
        knob = wire.truncating_knob(call)
        if knob is not None and facts.raw_logprobs == "refuse":
            raise EngineRejected(self.url, info.truncation_refusal(self.url, knob), knob)

    async def _held_then_aborted(self, rid: str) -> bool:
        """Hold a new call while this adapter has the engine paused; True when it was aborted
        meanwhile (it must then end without reaching the engine)."""
        aborted = self._held.setdefault(rid, asyncio.Event())
        opened = asyncio.ensure_future(self._open.wait())
        stopped = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait((opened, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            opened.cancel()
            stopped.cancel()
            self._held.pop(rid, None)
        return aborted.is_set()

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
        """POST /abort_request {"rid"} for each engine rid (SGLang takes one rid per call); a call
        this adapter holds is ended here instead (an abort sent for it would be lost)."""
        sent = []
        for rid in engine_request_ids:
            held = self._held.get(rid)
            if held is not None:
                held.set()
            else:
                sent.append(rid)
        await asyncio.gather(*(self._json("POST", "/abort_request", json_body={"rid": rid}) for rid in sent))

    async def pause(self, mode: str, timeout: float | EllipsisType | None = ...) -> None:
        """POST /pause_generation in SGLang's mode for `mode` (`wait` drains first, emulated);
        an abort pause over this adapter's `in_place` pause is `_abort_over_in_place`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}")
        self._open.clear()
        try:
            if mode == "wait":
                await self._drain(None if timeout is ... else timeout)
            if mode == "abort" and self._engine_mode == "in_place":
                await self._abort_over_in_place(timeout)
            await self._json(
                "POST", "/pause_generation", json_body={"mode": PAUSE_MODES[mode]}, timeout=timeout
            )
        except BaseException:
            if not self._paused:
                self._open.set()
            raise
        self._paused = True
        self._engine_mode = PAUSE_MODES[mode]
        if mode == "abort":
            for held in self._held.values():
                held.set()

    async def _abort_over_in_place(self, timeout: float | EllipsisType | None) -> None:
        """Make an abort pause safe on an engine frozen `in_place`: mark every request aborted
        (`abort_all`, which also pops the waiting queue), then continue, so the frozen requests
        take the one forward pass that ends them, ABORTED with their tokens. The abort pause the
        caller sends next then finds nothing frozen and ends (it also aborts whatever other
        clients' calls started in between)."""
        await self._json("POST", "/abort_request", json_body={"abort_all": True}, timeout=timeout)
        await self._json("POST", "/continue_generation", json_body={}, timeout=timeout)
        self._engine_mode = None

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
        self._engine_mode = None
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
        """`info.check`; keeps the facts each call is checked against (`_check_call`)."""
        caps, self._facts = await info.check(self, raw_logprobs)
        return caps

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
