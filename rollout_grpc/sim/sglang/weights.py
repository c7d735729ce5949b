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
from ..model import ToyLM
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


# ------------------------------------------------------------------ distributed transfer

INIT_OK = "Succeeded to initialize custom process group."
RECEIVED = "Succeeded to update parameter online."


async def init_weights_update_group(request: web.Request) -> web.StreamResponse:
    """`InitWeightsUpdateGroupReqInput` (`master_address`, `master_port`, `rank_offset`,
    `world_size` required; `group_name`, `backend`): joins the group (the real join blocks until
    every rank joined; here it returns at once)."""
    core: EngineCore = request.app[CORE_KEY]
    try:
        body = await _body(request)
        for name in ("master_address", "master_port", "rank_offset", "world_size"):
            if name not in body:
                raise SGLangValidationError(name, "Field required")
        info = {
            "master_address": _field(body, "master_address", str, None),
            "master_port": _field(body, "master_port", int, None),
            "rank_offset": _field(body, "rank_offset", int, None),
            "world_size": _field(body, "world_size", int, None),
            "backend": _field(body, "backend", str, "nccl"),
        }
        group = _field(body, "group_name", str, "weight_update_group")
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    core.transfer_groups[group] = info
    return json_response({"success": True, "message": INIT_OK})


async def update_weights_from_distributed(request: web.Request) -> web.StreamResponse:
    """`UpdateWeightsFromDistributedReqInput` (`names`, `dtypes`, `shapes` required; `group_name`,
    `weight_version`, ...): receives one broadcast in a joined group. A group that was never
    joined answers `success: false` (SGLang's wording for it is not verified)."""
    core: EngineCore = request.app[CORE_KEY]
    try:
        body = await _body(request)
        for name in ("names", "dtypes", "shapes"):
            if name not in body:
                raise SGLangValidationError(name, "Field required")
        names = _field(body, "names", list, None)
        shapes = _field(body, "shapes", list, None)
        group = _field(body, "group_name", str, "weight_update_group")
        version = _field(body, "weight_version", str, None)
    except (SGLangError, SGLangValidationError) as e:
        return _error_response(e)
    if group not in core.transfer_groups:
        message = f"Failed to update parameter online: group {group!r} is not initialized."
        return json_response({"success": False, "message": message}, status=400)
    if core.config.faults.load_fault == "error":
        message = "Failed to update parameter online: simulated worker failure while receiving weights."
        return json_response({"success": False, "message": message}, status=400)
    core.transfers += 1
    seed = weights.received_seed(list(names), list(shapes), core.transfers)
    core.swap_model(ToyLM(core.config.vocab_size, seed, core.config.eos_probability))
    core.stats.weight_loads += 1
    if version is not None:
        core.update_weight_version(version)
    return json_response({"success": True, "message": RECEIVED})
