"""vLLM routes the service never calls, kept for the live conformance comparison with vLLM.

The service (``rollout_grpc/server``) reaches an engine only through ``/health``, ``/v1/models``,
``/server_info``, ``/is_paused``, ``/pause``, ``/resume``, ``/update_weight_version``,
``/weight_info``, ``/inference/v1/generate``, ``/inference/v1/abort_requests``, the two render
routes and the weight routes of ``weights.py`` (``/collective_rpc``, ``/sleep``, ``/wake_up``,
``/is_sleeping``, ``/get_world_size`` and the weight-transfer lifecycle). The routes here are the
rest of vLLM 0.32's surface that a token-in/token-out client could meet: liveness and version, load
and Prometheus metrics, the tokenizer, the prefix and encoder cache resets (``/reset_mm_cache`` stays in
``control.py``: the service's multimodal tests evict the engine's cache with it). They are not
used by the service; they stay so that ``rollout-grpc sim`` answers every route a vLLM client may
probe with vLLM's exact body, and so that ``tests/sim`` (recorded bodies) and the live conformance
tier compare them with real vLLM.

Features of the generate path the service never asks for (``n`` > 1, ``prompt_logprobs``,
non-streaming answers, ``/v1/chat/completions`` — which ``bench/agentic.py`` uses as its baseline)
stay where they are: they share the generate code with what the service does use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .core import CORE_KEY, EngineCore
from .errors import ApiError, bad_request, json_response
from .request import read_json_body
from .vocab import render_chatml

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Wrap = Callable[[Handler], Handler]

METRICS_CT = "text/plain; version=1.0.0; charset=utf-8"
VERSION = "0.32.0"


def _core(request: web.Request) -> EngineCore:
    core: EngineCore = request.app[CORE_KEY]
    return core


def add_routes(router: web.UrlDispatcher, *, dev: Wrap) -> None:
    """Register the routes of this module; ``dev`` gates the development router's routes."""
    router.add_get("/ping", ping)
    router.add_post("/ping", ping)
    router.add_get("/version", version)
    router.add_get("/load", load)
    router.add_get("/metrics", metrics)
    router.add_post("/tokenize", tokenize)
    router.add_post("/detokenize", detokenize)
    development: list[tuple[str, str, Handler]] = [
        ("POST", "/reset_prefix_cache", reset_prefix_cache),
        ("POST", "/reset_encoder_cache", reset_encoder_cache),
        ("POST", "/release_kv_cache_memory", release_kv_cache_memory),
    ]
    for method, path, handler in development:
        router.add_route(method, path, dev(handler))


# ------------------------------------------------------------------ discovery and tokenizer


async def ping(request: web.Request) -> web.StreamResponse:
    return web.Response(status=503 if _core(request).config.faults.dead else 200)


async def version(request: web.Request) -> web.StreamResponse:
    return json_response({"version": VERSION})


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


# ------------------------------------------------------------------ development router


async def reset_prefix_cache(request: web.Request) -> web.StreamResponse:
    return json_response({"success": True})


async def reset_encoder_cache(request: web.Request) -> web.StreamResponse:
    return web.Response(status=200)


async def release_kv_cache_memory(request: web.Request) -> web.StreamResponse:
    return json_response({"status": "kv_cache_released"})
