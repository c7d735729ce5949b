"""Liveness, discovery, load, metrics and tokenizer endpoints (reference §8, §10.1)."""

from __future__ import annotations

import secrets
import time
from typing import Any

from aiohttp import web

from .core import CORE_KEY, EngineCore
from .errors import ApiError, bad_request, json_response
from .request import read_json_body
from .vocab import render_chatml

METRICS_CT = "text/plain; version=1.0.0; charset=utf-8"
VERSION = "0.32.0"


def _core(request: web.Request) -> EngineCore:
    core: EngineCore = request.app[CORE_KEY]
    return core


async def health(request: web.Request) -> web.StreamResponse:
    return web.Response(status=503 if _core(request).config.faults.dead else 200)


async def ping(request: web.Request) -> web.StreamResponse:
    return web.Response(status=503 if _core(request).config.faults.dead else 200)


async def version(request: web.Request) -> web.StreamResponse:
    return json_response({"version": VERSION})


async def models(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    cfg = core.config
    created = int(time.time())
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": cfg.model,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": cfg.root,
                    "parent": None,
                    "max_model_len": cfg.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{secrets.token_hex(8)}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    )


async def load(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    return json_response({"server_load": core.load if core.config.server_load_tracking else 0})


def _fmt(v: float) -> str:
    return repr(float(v))


async def metrics(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    m = core.config.model
    lbl = f'engine="0",model_name="{m}"'
    cap = max(1, core.config.max_model_len * core.config.max_num_seqs)
    used = sum(len(r.prompt_ids) + len(r.seqs[0].token_ids) for r in core.running)
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lbl}}} {_fmt(len(core.running))}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lbl}}} {_fmt(len(core.held))}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lbl}}} {_fmt(min(1.0, used / cap))}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason in ("stop", "length", "abort", "error", "repetition"):
        n = core.success_by_reason.get(reason, 0)
        lines.append(
            f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{m}"}} {_fmt(n)}'
        )
    lines += [
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{lbl}}} {_fmt(core.stats.prompt_tokens_total)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{lbl}}} {_fmt(core.stats.generation_tokens_total)}",
    ]
    return web.Response(body=("\n".join(lines) + "\n").encode(), headers={"Content-Type": METRICS_CT})


def _require_tokenizer(core: EngineCore) -> None:
    if core.config.tokens_only:
        raise bad_request("Tokenizer not available when skip_tokenizer_init=True")


def chat_messages_text(messages: Any) -> list[tuple[str, str]]:
    """Text-only messages as (role, content) pairs; list content keeps its text parts."""
    out: list[tuple[str, str]] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        out.append((str(m.get("role", "user")), "" if content is None else str(content)))
    return out


async def tokenize(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    _require_tokenizer(core)
    body = await read_json_body(request)
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    vocab = core.vocab
    if "messages" in body:
        text = render_chatml(
            chat_messages_text(body["messages"]),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
        )
    else:
        text = str(body.get("prompt", ""))
    ids = vocab.encode(text)
    strs = [vocab.token_piece(t) for t in ids] if body.get("return_token_strs") else None
    return json_response(
        {"count": len(ids), "max_model_len": core.config.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    _require_tokenizer(core)
    body = await read_json_body(request)
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ApiError(400, "tokens must be a list of integers", "BadRequestError")
    bad = [t for t in ids if not 0 <= t < core.config.vocab_size]
    if bad:
        raise bad_request(f"Token id {max(bad)} is out of vocabulary")
    return json_response({"prompt": core.vocab.decode(ids)})
