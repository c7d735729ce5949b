"""SGLang's discovery routes: health, model and server info, ``/v1/models`` and ``/v1/loads``
(``docs/sglang-http-api.md`` §6). The deprecated aliases ``/get_model_info`` and ``/get_server_info`` answer
too; ``/get_load`` and ``/get_weight_version`` do not exist in 0.5.23 and are not served."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from ..core import CORE_KEY, EngineCore
from ..errors import json_response
from . import admission
from .state import SGLANG_KEY


def _core(request: web.Request) -> EngineCore:
    return request.app[CORE_KEY]


async def health(request: web.Request) -> web.StreamResponse:
    """``/health`` and ``/health_generate``: 200 with an empty body, 503 while the engine is dead."""
    return web.Response(status=503 if _core(request).config.faults.dead else 200)


async def model_info(request: web.Request) -> web.StreamResponse:
    """The keys of SGLang 0.5.23's ``/model_info`` (``entrypoints/http_server.py`` 812-850)."""
    core = _core(request)
    cfg = core.config
    return json_response(
        {
            "model_path": cfg.root,
            "served_model_name": cfg.model,
            "tokenizer_path": None if cfg.tokens_only else cfg.root,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": core.version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
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
        "enable_deterministic_inference": cfg.sglang.enable_deterministic_inference,
        "allow_auto_truncate": False,
        "weight_version": core.version,
        "tp_size": 1,
        "dp_size": 1,
        "ep_size": 1,
        "random_seed": cfg.seed,
    }


async def server_info(request: web.Request) -> web.StreamResponse:
    """SGLang 0.5.23's order: ``build_server_info`` (server arguments, ``launch_command``, scheduler
    info, ``kv_events``; ``utils/common.py`` 3584-3593), then ``startup_time``, ``internal_states``,
    ``version``, ``frontend`` (``entrypoints/http_server.py`` 885-889)."""
    core = _core(request)
    cfg = core.config
    body = server_args(core)
    body["launch_command"] = None  # set only by the ``sglang serve`` launcher
    body["max_req_input_len"] = admission.max_req_input_len(cfg.max_model_len)
    body["max_total_num_tokens"] = cfg.max_model_len * cfg.max_num_seqs
    body["kv_events"] = None  # no KV-event publisher
    body["startup_time"] = request.app[SGLANG_KEY].startup_time
    body["internal_states"] = [{"last_gen_throughput": 0.0}]
    body["version"] = cfg.sglang.version
    body["frontend"] = "python"
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


def _load_counts(request: web.Request) -> dict[str, int]:
    """Running and waiting requests (held ones wait) and the tokens they hold."""
    state = request.app[SGLANG_KEY]
    core = state.core
    admitted = state.admitted()
    waiting = sum(1 for r in core.tracked() if not r.admitted and not r.done.is_set())
    used = sum(len(r.prompt_ids) + r.n_out for r in admitted)
    total = core.config.max_model_len * core.config.max_num_seqs
    return {"running": len(admitted), "waiting": waiting, "used": used, "total": total}


async def loads(request: web.Request) -> web.StreamResponse:
    """``/v1/loads``: the envelope of ``entrypoints/v1_loads.py`` with one DP rank's core counts."""
    c = _load_counts(request)
    load = {
        "dp_rank": 0,
        "num_running_reqs": c["running"],
        "num_waiting_reqs": c["waiting"],
        "num_used_tokens": c["used"],
        "num_total_tokens": c["total"],
    }
    return json_response(
        {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": _core(request).config.sglang.version,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [load],
        }
    )
