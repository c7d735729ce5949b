"""Abort, pause/resume, weight versions, server info and the multimodal cache (reference §4, §5).

The routes of the same family the service never calls (sleep, caches, collective RPC, weight
transfer) are in ``fidelity.py``.

The ``/pause`` family answers engine failures with ``{"error":"<string>"}`` in vLLM, unlike every
other route; the simulator has no engine failures there, but keeps the success bodies exact.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from .core import CORE_KEY, EngineCore
from .errors import ApiError, json_response, validation_error
from .request import parse_json_bytes

_BOOL_TRUE = {"1", "true", "t", "yes", "y", "on"}
_BOOL_FALSE = {"0", "false", "f", "no", "n", "off"}


def _core(request: web.Request) -> EngineCore:
    core: EngineCore = request.app[CORE_KEY]
    return core


async def json_or_none(request: web.Request) -> Any:
    data = await request.read()
    if not data.strip():
        return None
    return parse_json_bytes(data)


async def _starlette_json(request: web.Request) -> Any:
    """``await raw_request.json()``: ``json.JSONDecodeError`` on an empty or malformed body."""
    return json.loads(await request.read() or b"")


def _query_bool(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _BOOL_TRUE:
        return True
    if v in _BOOL_FALSE:
        return False
    raise validation_error(
        [
            {
                "type": "bool_parsing",
                "loc": f"query.{name}",
                "msg": "Input should be a valid boolean, unable to interpret input",
                "input": raw,
            }
        ]
    )


def query_mode(request: web.Request) -> str:
    mode = request.query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise validation_error(
            [
                {
                    "type": "literal_error",
                    "loc": "query.mode",
                    "msg": "Input should be 'abort', 'wait' or 'keep'",
                    "input": mode,
                    "ctx": "{'expected': \"'abort', 'wait' or 'keep'\"}",
                }
            ]
        )
    return mode


async def scaleout_abort(request: web.Request) -> web.StreamResponse:
    """``POST /inference/v1/abort_requests``: 200 with an empty body and no content type."""
    core = _core(request)
    core.stats.abort_calls += 1
    try:
        body = await _starlette_json(request)
    except json.JSONDecodeError as e:
        return ApiError(400, f"JSON decode error: {e}", "Bad Request").response()
    if not isinstance(body, dict):
        return web.Response(status=500, text="Internal Server Error")  # vLLM: body.get on a non-dict
    if body.get("request_ids") is None:
        return ApiError(400, "Missing 'request_ids' in request body", "Bad Request").response()
    ids = body["request_ids"]
    if isinstance(ids, str):
        ids = [ids]
    core.abort_ids([str(i) for i in ids or []])
    return web.Response(status=200)


async def dev_abort(request: web.Request) -> web.StreamResponse:
    """``POST /abort_requests`` (RL dev router): counts the ids sent; an empty or missing list
    aborts everything. The body must be a JSON object (``{}`` works; a zero-length body is 400)."""
    core = _core(request)
    core.stats.abort_calls += 1
    try:
        body = await _starlette_json(request)
    except json.JSONDecodeError:
        return ApiError(400, "Invalid JSON format", "Bad Request").response()
    if not isinstance(body, dict):
        return ApiError(400, "Request body must be a JSON object", "Bad Request").response()
    ids = body.get("request_ids")
    if not ids:
        n = core.abort_all()
        return json_response({"status": "aborted", "aborted": n})
    if isinstance(ids, str):
        ids = [ids]
    core.abort_ids([str(i) for i in ids])
    return json_response({"status": "aborted", "aborted": len(ids)})


async def pause(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    core.stats.pause_calls += 1
    mode = query_mode(request)
    delay_ms = core.config.faults.pause_delay_ms
    if delay_ms > 0:
        async with core.control_lock:  # the engine step in progress ends first
            await asyncio.sleep(delay_ms / 1000)
    if _query_bool(request, "clear_cache", True):
        # AsyncLLM.pause_generation clears the renderer's multimodal cache first, in every mode:
        # a later generate with kwargs_data null for an earlier hash then fails with 500.
        core.mm_cache.clear()
    await core.pause(mode)
    return json_response({"status": "paused"})


async def resume(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    core.stats.resume_calls += 1
    faults = core.config.faults
    # The fault is a plain value a test or the admin route clears: nothing signals it.
    while faults.resume_fault == "hang":  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    if faults.resume_fault == "error":
        raise ApiError(503, "simulated control failure: resume not run", "Service Unavailable")
    async with core.control_lock:  # after a pause sent before it (vLLM's control calls are FIFO)
        pass
    core.resume()
    return json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.StreamResponse:
    return json_response({"is_paused": _core(request).paused})


async def update_weight_version(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    body = await json_or_none(request)
    if not isinstance(body, dict) or "new_version" not in body:
        raise validation_error(
            [{"type": "missing", "loc": "body.new_version", "msg": "Field required", "input": body or {}}]
        )
    v = body["new_version"]
    if not isinstance(v, str):
        raise validation_error(
            [
                {
                    "type": "string_type",
                    "loc": "body.new_version",
                    "msg": "Input should be a valid string",
                    "input": v,
                }
            ]
        )
    core.stats.weight_version_updates += 1
    core.update_weight_version(v)
    return json_response({"success": True, "new_version": v})


async def weight_info(request: web.Request) -> web.StreamResponse:
    return json_response({"weight_version": _core(request).version})


async def reset_mm_cache(request: web.Request) -> web.StreamResponse:
    _core(request).mm_cache.clear()
    return web.Response(status=200)


async def server_info(request: web.Request) -> web.StreamResponse:
    """``GET /server_info?config_format=text|json`` (default text, like vLLM).

    The JSON form carries the ``VllmConfig`` sections a client reads (model, scheduler, parallel
    and aux-output configuration), not vLLM's full dump.
    """
    core = _core(request)
    cfg = core.config
    fmt = request.query.get("config_format", "text")
    if fmt not in ("text", "json"):
        raise validation_error(
            [
                {
                    "type": "literal_error",
                    "loc": "query.config_format",
                    "msg": "Input should be 'text' or 'json'",
                    "input": fmt,
                    "ctx": "{'expected': \"'text' or 'json'\"}",
                }
            ]
        )
    routed = cfg.return_routed_experts and not cfg.faults.routed_experts_unavailable
    config: dict[str, Any] = {
        "model_config": {
            "model": cfg.root,
            "served_model_name": cfg.model,
            "tokenizer": cfg.root,
            "skip_tokenizer_init": cfg.tokens_only,
            "dtype": "bfloat16",
            "max_model_len": cfg.max_model_len,
            "max_logprobs": cfg.max_logprobs,
            "logprobs_mode": cfg.logprobs_mode,
        },
        "cache_config": {"enable_prefix_caching": True},
        "parallel_config": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "is_moe_model": cfg.is_moe,
        },
        "scheduler_config": {"max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len},
        "aux_output_config": {"enable_return_routed_experts": routed, "max_bytes": None},
        "weight_transfer_config": None,
    }
    text = ", ".join(f"{k}={v!r}" for k, v in config.items())
    return json_response(
        {
            "vllm_config": config if fmt == "json" else text,
            "vllm_env": {"VLLM_SERVER_DEV_MODE": True},
            "system_env": {"simulated": True},
        }
    )
