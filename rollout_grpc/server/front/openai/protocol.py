"""The OpenAI chat-completions protocol for the front door: request fields, errors, finish reasons.

Pure translation between OpenAI's JSON and the domain (no I/O): sampling fields -> `SamplingParams`
(a wrong type names the field), domain errors -> OpenAI's error envelope and HTTP status, and the
domain's finish reasons -> OpenAI's `finish_reason` strings (vLLM's `"abort"` and `"error"` kept).
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from aiohttp import web

from rollout_grpc.server.domain.chat import ChatRenderRequest
from rollout_grpc.server.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RolloutError,
)
from rollout_grpc.server.domain.model import Finish, SamplingParams

#: Domain finish reasons as OpenAI `finish_reason` strings (vLLM's "abort" and "error" kept).
FINISH = {
    Finish.STOP: "stop",
    Finish.LENGTH: "length",
    Finish.ABORT: "abort",
    Finish.ERROR: "error",
    Finish.REPETITION: "stop",
    Finish.UNSPECIFIED: "stop",
}


#: Session ids (`X-Session-Id`, `/sessions/{id}/...`): the characters of the request-id rule (gRPC
#: metadata-, header- and log-safe; `~` excluded, as in request ids), at most 200 of them: a
#: turn's request id is `<session id>.t<turn>.<8 hex>` and must itself be a valid request id.
SESSION_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,200}")
SESSION_ID_RULE = "must be 1-200 characters of A-Z a-z 0-9 . _ : / @ + = -"
#: Content parts that are not text (their bytes have limits of their own).
_MEDIA_PARTS = frozenset({"image_url", "input_audio", "video_url", "audio_url", "file"})


class OpenAIError(Exception):
    """An OpenAI error envelope with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, etype: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.etype = etype or ("invalid_request_error" if status < 500 else "server_error")
        self.headers: dict[str, str] = {}


def check_session_id(session_id: str) -> None:
    """A 400 naming `session_id` unless it follows SESSION_ID. Checked before the turn runs: a
    control character used to run the turn and then break the response header echoing it, and a
    non-UTF-8 one (surrogates after aiohttp's decoding) to fail the log line."""
    if SESSION_ID.fullmatch(session_id) is None:
        shown = session_id[:64].encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        raise OpenAIError(400, f"session_id: {SESSION_ID_RULE}; got {shown!r}", "session_id")


def text_chars(value: Any) -> int:
    """Characters of every string in `value` (parsed JSON, so bounded by the body cap), media
    parts skipped."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            if item.get("type") in _MEDIA_PARTS:
                continue
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def from_domain(exc: RolloutError) -> OpenAIError:
    """Domain errors as OpenAI errors (400 naming the request field, 404, 429, 503)."""
    if isinstance(exc, InvalidArgument):
        param = exc.field.removeprefix("sampling_params.").replace("max_new_tokens", "max_tokens")
        return OpenAIError(400, f"{param}: {exc.description}", param)
    if isinstance(exc, FailedPrecondition):
        return OpenAIError(400, exc.message)
    if isinstance(exc, PermissionDenied):
        return OpenAIError(403, exc.message, etype="permission_denied")
    if isinstance(exc, NotFound):
        return OpenAIError(404, exc.message, etype="not_found_error")
    if isinstance(exc, ResourceExhausted):
        err = OpenAIError(429, exc.message, etype="rate_limit_error")
        err.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        return err
    return OpenAIError(503, exc.message)


def error_response(err: OpenAIError) -> web.Response:
    body = {"error": {"message": err.message, "type": err.etype, "param": err.param, "code": err.status}}
    return web.Response(
        status=err.status, body=orjson.dumps(body), content_type="application/json", headers=err.headers
    )


def _number(body: dict[str, Any], key: str, kind: type[int] | type[float]) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and isinstance(value, float))
    ):
        wanted = "an integer" if kind is int else "a number"
        raise OpenAIError(400, f"{key}: must be {wanted}, got {value!r}", key)
    return kind(value)


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """OpenAI (and vLLM extra) sampling fields as domain parameters; wrong types name the field."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise OpenAIError(400, "stop: must be a string or a list of strings", "stop")
    max_tokens = _number(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise OpenAIError(400, "stop_token_ids: must be a list of token ids", "stop_token_ids")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise OpenAIError(400, "logit_bias: must map token ids to biases", "logit_bias")
    try:
        logit_bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise OpenAIError(400, "logit_bias: must map token ids to biases", "logit_bias") from None
    return SamplingParams(
        temperature=_number(body, "temperature", float),
        top_p=_number(body, "top_p", float),
        top_k=_number(body, "top_k", int),
        min_p=_number(body, "min_p", float),
        max_new_tokens=max_tokens,
        min_new_tokens=_number(body, "min_tokens", int),
        stop=list(stop or []),
        stop_token_ids=list(stop_ids),
        ignore_eos=body.get("ignore_eos") if isinstance(body.get("ignore_eos"), bool) else None,
        # OpenAI's (and vLLM's chat endpoint's) default: no special tokens in the content.
        skip_special_tokens=body.get("skip_special_tokens")
        if isinstance(body.get("skip_special_tokens"), bool)
        else True,
        seed=_number(body, "seed", int),
        repetition_penalty=_number(body, "repetition_penalty", float),
        presence_penalty=_number(body, "presence_penalty", float),
        frequency_penalty=_number(body, "frequency_penalty", float),
        logit_bias=logit_bias,
    )


def finish_reason(finish: Finish, tool_calls: bool) -> str:
    """OpenAI's finish_reason; parsed tool calls make it "tool_calls" unless the turn was cut off
    by an abort or an error (as vLLM's chat endpoint does)."""
    if tool_calls and finish in (Finish.STOP, Finish.LENGTH, Finish.REPETITION):
        return "tool_calls"
    return FINISH[finish]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def render_request(
    messages: list[dict[str, Any]], body: dict[str, Any], model: str, *, add_generation_prompt: bool = True
) -> ChatRenderRequest:
    """The engine render of `messages` with the request fields that shape the prompt (tools,
    template and its arguments, documents), passed through unchanged."""
    return ChatRenderRequest(
        messages,
        add_generation_prompt=add_generation_prompt,
        model=model,
        tools=body.get("tools"),
        chat_template_kwargs=body.get("chat_template_kwargs"),
        chat_template=body.get("chat_template"),
        documents=body.get("documents"),
    )
