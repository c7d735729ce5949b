"""SGLang's weight routes on the simulated engine (SGLang 0.5.23's bodies and replies).

Body `UpdateWeightFromDiskReqInput` (`model_path` required; `abort_all_requests`, `weight_version`,
`flush_cache`, ... optional); 200 `{"success": true, "message": "Succeeded to update model
weights.", "num_paused_requests": 0}`, or 400 with `"success": false` and the rolled-back load's
message (SGLang keeps serving the old weights, unlike vLLM). A paused engine loads at once, as in
SGLang; an unpaused one also loads at once here (SGLang waits for its model-update lock first).

`/release_memory_occupation` and `/resume_memory_occupation` (GET or POST, body `{"tags": [...]}`,
null: `weights` and `kv_cache`) answer 200 with a `null` body. SGLang's scheduler asserts that the
engine is idle before releasing ("release_memory_occupation should be called only when server is
idle."); how that assertion reaches the HTTP client is not verified: here it is the route's error
envelope, 400.
"""

from __future__ import annotations

from aiohttp import web

from .. import weights
from ..core import CORE_KEY, EngineCore
from ..errors import json_response
from .control import _body, _error_response, _field
from .errors import SGLangError, SGLangValidationError
from .state import SGLANG_KEY, SGLangState

SUCCEEDED = "Succeeded to update model weights."


async def update_weights_from_disk(request: web.Request) -> web.StreamResponse:
    core: EngineCore = request.app[CORE_KEY]
    state: SGLangState = request.app[SGLANG_KEY]
    try:
        body = await _body(request)
        if "model_path" not in body:
            raise SGLangValidationError("model_path", "Field required")
        path = _field(body, "model_path", str, None)
        abort_all = _field(body, "abort_all_requests", bool, False)
        version = _field(body, "weight_version", str, None)
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    if abort_all:
        for r in state.abort_all():
            await r.done.wait()
    if core.config.faults.load_fault == "drop":
        if request.transport is not None:
            request.transport.abort()
        core.config.faults.dead = True
        raise ConnectionResetError("simulated crash while loading weights")
    try:
        await weights.load_checkpoint(core, path)
    except weights.LoadError as exc:
        message = f"Failed to update weights: {exc}.\nRolling back to original weights."
        return json_response({"success": False, "message": message, "num_paused_requests": 0}, status=400)
    message = SUCCEEDED
    if version is not None:
        core.update_weight_version(version)
        message += f" Weight version updated to {version}."
    return json_response({"success": True, "message": message, "num_paused_requests": 0})


ALL_TAGS = ("weights", "kv_cache")
NOT_IDLE = "release_memory_occupation should be called only when server is idle."


async def _tags(request: web.Request) -> list[str] | None:
    body = await _body(request)
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise SGLangValidationError("tags", f"Input should be a valid list, got {tags!r}")
    return tags


async def release_memory_occupation(request: web.Request) -> web.StreamResponse:
    core: EngineCore = request.app[CORE_KEY]
    state: SGLangState = request.app[SGLANG_KEY]
    try:
        tags = await _tags(request)
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    if state.admitted():
        return json_response({"error": {"message": NOT_IDLE}}, status=400)
    core.asleep_tags.update(tags or ALL_TAGS)
    core.sleeping = True
    return json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.StreamResponse:
    core: EngineCore = request.app[CORE_KEY]
    try:
        tags = await _tags(request)
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    core.asleep_tags.difference_update(tags or ALL_TAGS)
    core.sleeping = bool(core.asleep_tags)
    return json_response(None)
