"""``POST /v1/chat/completions`` (text only): the chat template, generation and vLLM's OpenAI shape.

What vLLM 0.32 answers on its own chat endpoint (reference §7 and the OpenAI API): non-streaming
``chat.completion`` with ``message.content``, ``finish_reason``, ``stop_reason``, ``token_ids`` on
the choice (with ``return_token_ids``, plus top-level ``prompt_token_ids``), and ``usage``;
streaming ``chat.completion.chunk`` events (a first role chunk, content deltas, a final chunk with
``finish_reason``, an optional usage chunk with ``stream_options.include_usage``, ``[DONE]``).
The prompt is rendered exactly as ``/v1/chat/completions/render`` does. Tool parsing is not
simulated (vLLM needs ``--tool-call-parser`` for it); the endpoint exists so that benchmarks can
compare the rollout service's front door with the engine's own chat endpoint.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any

import orjson
from aiohttp import web

from .core import CORE_KEY, EngineCore
from .errors import ApiError, bad_request, json_response
from .params import parse_sampling_params
from .render import _check_common, _message_text, _resolve_max_tokens, openai_sampling_params
from .request import read_json_body

SSE_CT = "text/event-stream; charset=utf-8"


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    core: EngineCore = request.app[CORE_KEY]
    try:
        body = _check_common(core, await read_json_body(request))
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list")
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                raise bad_request("messages must be objects")
            parts.append((str(m.get("role", "user")), await _message_text(core, m.get("content"), [])))
        body.setdefault("skip_special_tokens", True)
        sp = parse_sampling_params(openai_sampling_params(body, chat=True))
        text = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in parts) + "<|im_start|>assistant\n"
        ids = core.vocab.encode(text)
        max_tokens = _resolve_max_tokens(core, sp, len(ids), from_text=True)
    except ApiError as e:
        return e.response()
    rid = "chatcmpl-" + secrets.token_hex(16)
    ereq = core.new_request(rid, ids, sp, max_out=max_tokens, want_text=True)
    created = int(time.time())
    model = core.config.model
    if not body.get("stream"):
        async with contextlib.aclosing(core.run(ereq)) as run:
            async for _ in run:
                pass
        seq = ereq.seqs[0]
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": seq.text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": seq.finish_reason or "stop",
            "stop_reason": seq.stop_reason,
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = list(seq.token_ids)
        result: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(seq.token_ids),
                "total_tokens": len(ids) + len(seq.token_ids),
            },
        }
        if body.get("return_token_ids"):
            result["prompt_token_ids"] = ids
        return json_response(result)
    resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CT})
    await resp.prepare(request)
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    await resp.write(_sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    seq = ereq.seqs[0]
    sent = 0
    async with contextlib.aclosing(core.run(ereq)) as run:
        async for _ in run:
            n = len(seq.token_ids)
            finished = seq.finish_reason is not None
            if n == sent and not finished:
                continue
            delta = {"content": seq.take_text_delta()}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": seq.finish_reason}
            if finished:
                choice["stop_reason"] = seq.stop_reason
            if body.get("return_token_ids"):
                choice["token_ids"] = list(seq.token_ids[sent:n])
            sent = n
            await resp.write(_sse({**base, "choices": [choice]}))
            if finished:
                break
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        usage = {"prompt_tokens": len(ids), "completion_tokens": sent, "total_tokens": len(ids) + sent}
        await resp.write(_sse({**base, "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
