"""SGLang's control routes: abort, pause/continue, weight version and cache flush
(``docs/sglang-http-api.md`` §4, §5).

Bodies are the server's ``*ReqInput`` structs decoded by FastAPI: a missing body, a missing required
field or a wrong type is the flat validation envelope, an unknown key is ignored.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..core import CORE_KEY, EngineCore
from ..errors import ApiError, json_response
from ..request import parse_json_bytes
from .errors import SGLangError, SGLangValidationError
from .state import PAUSE_MODES, SGLANG_KEY, SGLangState


def _state(request: web.Request) -> SGLangState:
    return request.app[SGLANG_KEY]


def _core(request: web.Request) -> EngineCore:
    return request.app[CORE_KEY]


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object body. FastAPI requires it even when every field has a default (the handler
    takes the struct as a body parameter), so an empty body is a validation error: send ``{}``."""
    data = await request.read()
    if not data.strip():
        raise SGLangValidationError("", "Field required")
    try:
        body = parse_json_bytes(data)
    except ApiError:
        raise SGLangValidationError("", "JSON decode error") from None
    if not isinstance(body, dict):
        raise SGLangValidationError("", "Input should be a valid dictionary")
    return body


def _field(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    v = body.get(name, default)
    if v is None and default is None:
        return None
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        raise SGLangValidationError(name, f"Input should be a valid {kind.__name__}, got {v!r}")
    return v


def _error_response(e: Exception) -> web.Response:
    if isinstance(e, (SGLangError, SGLangValidationError)):
        return e.response()
    raise e


async def abort_request(request: web.Request) -> web.StreamResponse:
    """``{"rid": …}`` or ``{"abort_all": true}``: 200 with an empty body, whether or not anything
    was in flight."""
    core = _core(request)
    core.stats.abort_calls += 1
    try:
        body = await _body(request)
        rid = _field(body, "rid", str, None)
        abort_all = _field(body, "abort_all", bool, False)
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    state = _state(request)
    if abort_all:
        state.abort_all()
    elif rid:
        state.abort(rid)
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    core.stats.pause_calls += 1
    try:
        body = await _body(request)
        mode = _field(body, "mode", str, "abort")
        if mode not in PAUSE_MODES:
            raise SGLangValidationError(
                "mode", f"Input should be 'abort', 'retract' or 'in_place', got {mode!r}"
            )
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    await _state(request).pause(mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    core.stats.resume_calls += 1
    try:
        body = await _body(request)
        _field(body, "torch_empty_cache", bool, True)
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    await _state(request).resume()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


async def update_weight_version(request: web.Request) -> web.StreamResponse:
    """``{"new_version", "abort_all_requests": true}``: by default everything in flight is aborted
    first (its tokens keep the old version); with ``false`` running requests go on and their spans
    split where the new version starts."""
    core = _core(request)
    try:
        body = await _body(request)
        if "new_version" not in body:
            raise SGLangValidationError("new_version", "Field required")
        version = _field(body, "new_version", str, None)
        if version is None:
            raise SGLangValidationError("new_version", "Input should be a valid string, got None")
        abort_all = _field(body, "abort_all_requests", bool, True)
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    if abort_all:
        for r in _state(request).abort_all():
            await r.done.wait()
    core.stats.weight_version_updates += 1
    core.update_weight_version(version)
    return json_response(
        {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
    )


async def flush_cache(request: web.Request) -> web.StreamResponse:
    """Plain text, 200 when flushed; 400 when requests still hold KV cache (the scheduler's message,
    or SGLang's fallback ``Flush cache failed.``)."""
    if _state(request).flush_cache():
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n"
        )
    return web.Response(status=400, text="Flush cache failed.\n")
