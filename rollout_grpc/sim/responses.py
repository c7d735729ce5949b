"""Response bodies and SSE chunks of ``/inference/v1/generate`` in vLLM's exact key order.

Key orders follow the pydantic models of vLLM 0.32 (reference §3.3, §3.4, §10.2): the
non-streaming ``GenerateResponse``, the streaming ``GenerateStreamResponse`` (no ``model``/``created``;
``prompt_token_ids``/``mm_placeholders``/``metrics`` only when not null) and the choice objects.
The common streaming chunk (tokens mode, no logprobs, no usage) is rendered from a byte template
so a token costs one small concatenation instead of a JSON encode.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from .model import clamp_logprob
from .sequence import Sequence, TokenLogprob
from .vocab import Vocab

DONE = b"data: [DONE]\n\n"


def _f32(x: float) -> float:
    return clamp_logprob(x)


def tokens_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """``{"content":[{token_id, logprob, rank, top_logprobs:[…]}]}`` (tokens mode)."""
    return {
        "content": [
            {
                "token_id": e.token_id,
                "logprob": _f32(e.logprob),
                "rank": e.rank,
                "top_logprobs": [{"token_id": t, "logprob": _f32(lp), "rank": r} for t, lp, r in e.top],
            }
            for e in entries
        ]
    }


def text_logprobs(entries: list[TokenLogprob], vocab: Vocab) -> dict[str, Any]:
    """OpenAI shape for ``output_mode:"text"``: ``{token, logprob, bytes, top_logprobs}``."""
    out = []
    for e in entries:
        tok = vocab.token_str(e.token_id)
        out.append(
            {
                "token": tok,
                "logprob": _f32(e.logprob),
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": vocab.token_str(t),
                        "logprob": _f32(lp),
                        "bytes": list(vocab.token_str(t).encode("utf-8")),
                    }
                    for t, lp, _ in e.top
                ],
            }
        )
    return {"content": out}


def choice_dict(
    seq: Sequence,
    *,
    token_ids: list[int],
    logprob_entries: list[TokenLogprob] | None,
    final: bool,
    routed_experts: str | None,
    text: str | None,
    vocab: Vocab,
    nonstream: bool,
) -> dict[str, Any]:
    """One choice; ``final`` decides whether finish/stop/weight_versions are filled."""
    d: dict[str, Any] = {
        "index": seq.index,
        "finish_reason": (seq.finish_reason or ("stop" if nonstream else None)) if final else None,
        "stop_reason": seq.stop_reason if final else None,
        "token_ids": token_ids,
        "routed_experts": routed_experts,
        "sampling_mask": None,
        "weight_versions": seq.weight_versions() if final else None,
    }
    if text is not None:
        d["text"] = text
    if logprob_entries is None:
        d["logprobs"] = None
    elif text is not None:
        d["logprobs"] = text_logprobs(logprob_entries, vocab)
    else:
        d["logprobs"] = tokens_logprobs(logprob_entries)
    return d


def usage(prompt_tokens: int, completion_tokens: int, *, details: bool = True) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        u["prompt_tokens_details"] = None
        u["completion_tokens_details"] = None
    return u


def nonstream_body(
    *,
    request_id: str,
    model: str,
    created: int,
    prompt_len: int,
    prompt_token_ids: list[int] | None,
    mm_placeholders: dict[str, Any] | None,
    prompt_logprobs: list[Any] | None,
    output_mode: str,
    choices: list[dict[str, Any]],
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "model": model,
        "created": created,
        "usage": usage(prompt_len, completion_tokens),
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "mm_placeholders": mm_placeholders,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": output_mode,
        "choices": choices,
    }


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_chunk(
    *,
    request_id: str,
    usage_obj: dict[str, Any] | None,
    prompt_token_ids: list[int] | None,
    mm_placeholders: dict[str, Any] | None,
    output_mode: str,
    choice: dict[str, Any],
) -> bytes:
    d: dict[str, Any] = {"request_id": request_id, "usage": usage_obj}
    if prompt_token_ids is not None:
        d["prompt_token_ids"] = prompt_token_ids
    if mm_placeholders is not None:
        d["mm_placeholders"] = mm_placeholders
    d["output_mode"] = output_mode
    d["choices"] = [choice]
    return sse(d)


def usage_chunk(request_id: str, prompt_tokens: int, completion_tokens: int, output_mode: str) -> bytes:
    """The ``include_usage`` chunk, serialised with ``exclude_none`` (no ``*_details`` keys)."""
    return sse(
        {
            "request_id": request_id,
            "usage": usage(prompt_tokens, completion_tokens, details=False),
            "output_mode": output_mode,
            "choices": [],
        }
    )


def error_event(body: dict[str, Any] | None = None) -> bytes:
    """An in-stream error event (default: vLLM's internal error). vLLM writes stream errors with
    ``json.dumps`` (default separators, not compact), in its usual envelope."""
    if body is None:
        body = {
            "error": {
                "message": "Internal server error",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class PlainChunkTemplate:
    """Byte template for the common mid-stream chunk (tokens mode, no logprobs, no usage)."""

    __slots__ = ("_prefix", "_suffix")

    def __init__(self, request_id: str, index: int) -> None:
        self._prefix = (
            b'data: {"request_id":'
            + orjson.dumps(request_id)
            + b',"usage":null,"output_mode":"tokens","choices":[{"index":'
            + str(index).encode()
            + b',"finish_reason":null,"stop_reason":null,"token_ids":['
        )
        self._suffix = (
            b'],"routed_experts":null,"sampling_mask":null,"weight_versions":null,"logprobs":null}]}\n\n'
        )

    def render(self, token_ids: list[int]) -> bytes:
        ids = str(token_ids[0]).encode() if len(token_ids) == 1 else ",".join(map(str, token_ids)).encode()
        return self._prefix + ids + self._suffix
