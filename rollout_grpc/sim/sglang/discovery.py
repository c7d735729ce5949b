"""SGLang's discovery routes: health, model and server info, ``/v1/models`` and ``/v1/loads``
(``docs/sglang-http-api.md`` §6). Both the old ``/get_*`` paths and the newer short ones answer."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from ..core import CORE_KEY, EngineCore
from ..errors import json_response
from .state import SGLANG_KEY


def _core(request: web.Request) -> EngineCore:
    return request.app[CORE_KEY]


async def health(request: web.Request) -> web.StreamResponse:
    """``/health`` and ``/health_generate``: 200 with an empty body, 503 while the engine is dead."""
    return web.Response(status=503 if _core(request).config.faults.dead else 200)


async def model_info(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    cfg = core.config
    return json_response(
        {
            "model_path": cfg.root,
            "tokenizer_path": None if cfg.tokens_only else cfg.root,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": core.version,
            "has_image_understanding": cfg.multimodal,
            "has_audio_understanding": False,
            "model_type": "qwen2_vl" if cfg.multimodal else ("qwen3_moe" if cfg.is_moe else "llama"),
            "architectures": ["SimForCausalLM"],
        }
    )


def server_args(core: EngineCore) -> dict[str, Any]:
    """The ``ServerArgs`` fields a client reads (SGLang dumps all of them)."""
    cfg = core.config
    routed = cfg.return_routed_experts and not cfg.faults.routed_experts_unavailable
    return {
        "model_path": cfg.root,
        "tokenizer_path": None if cfg.tokens_only else cfg.root,
        "served_model_name": cfg.model,
        "context_length": cfg.max_model_len,
        "skip_tokenizer_init": cfg.tokens_only,
        "enable_return_routed_experts": routed,
        "incremental_streaming_output": cfg.sglang.incremental_streaming_output,
        "stream_interval": cfg.sglang.stream_interval,
        "allow_auto_truncate": False,
        "weight_version": core.version,
        "tp_size": 1,
        "dp_size": 1,
        "ep_size": 1,
        "random_seed": cfg.seed,
    }


async def server_info(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    cfg = core.config
    body = server_args(core)
    body["max_req_input_len"] = cfg.max_model_len - 1
    body["max_total_num_tokens"] = cfg.max_model_len * cfg.max_num_seqs
    body["internal_states"] = [{"last_gen_throughput": 0.0}]
    body["version"] = cfg.sglang.version
    return json_response(body)


async def models(request: web.Request) -> web.StreamResponse:
    cfg = _core(request).config
    card = {
        "id": cfg.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": cfg.root,
        "max_model_len": cfg.max_model_len,
    }
    return json_response({"object": "list", "data": [card]})


async def loads(request: web.Request) -> web.StreamResponse:
    """``/v1/loads``: per-DP running and waiting counts (held requests count as waiting)."""
    state = request.app[SGLANG_KEY]
    core = state.core
    running = len(state.admitted())
    waiting = sum(1 for r in core.tracked() if not r.admitted and not r.done.is_set())
    load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting}
    return json_response({"loads": [load]})
