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

from rollout_grpc.server.domain import params
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
        param = params.openai_name(exc.field)
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


#: Knobs of the table the OpenAI door does not offer (an empty alias column), with the reason.
NOT_OFFERED: dict[str, str] = {
    "top_logprobs": "the door answers `logprobs: null`: token logprobs are in the recorded trajectory",
}
#: Where OpenAI's default differs from the rollout default of the knob table.
OPENAI_DEFAULTS: dict[str, Any] = {
    # OpenAI's (and vLLM's chat endpoint's) default: no special tokens in the content.
    "skip_special_tokens": True,
}


def _stop(body: dict[str, Any], key: str) -> list[str] | None:
    value = body.get(key)
    if isinstance(value, str):
        value = [value]
    if value is not None and (not isinstance(value, list) or not all(isinstance(s, str) for s in value)):
        raise OpenAIError(400, f"{key}: must be a string or a list of strings", key)
    return value


def _token_ids(body: dict[str, Any], key: str) -> list[int] | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, list) or not all(isinstance(t, int) for t in value)):
        raise OpenAIError(400, f"{key}: must be a list of token ids", key)
    return value


def _bias(body: dict[str, Any], key: str) -> dict[int, float] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise OpenAIError(400, f"{key}: must map token ids to biases", key)
    try:
        return {int(k): float(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise OpenAIError(400, f"{key}: must map token ids to biases", key) from None


def _flag(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(400, f"{key}: must be a boolean, got {value!r}", key)
    return value


#: How a JSON value is read, by the type of the knob's field on the domain dataclass.
_READERS: dict[str, Any] = {
    "float | None": lambda body, key: _number(body, key, float),
    "int | None": lambda body, key: _number(body, key, int),
    "bool | None": _flag,
    "list[str]": _stop,
    "list[int]": _token_ids,
    "dict[int, float]": _bias,
}


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """OpenAI (and vLLM extra) sampling fields as domain parameters, read through the alias column
    of the knob table (`domain/params.py`); a wrong type names the field."""
    fields = SamplingParams.__dataclass_fields__
    values: dict[str, Any] = {}
    for knob in params.KNOBS:
        read = _READERS[str(fields[knob.name].type)]
        for key in knob.openai:  # the last one set wins
            value = read(body, key)
            if value is not None:
                values[knob.name] = value
        if knob.name not in values and knob.name in OPENAI_DEFAULTS:
            values[knob.name] = OPENAI_DEFAULTS[knob.name]
    return SamplingParams(**values)


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
