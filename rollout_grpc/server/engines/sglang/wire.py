"""SGLang's request side: engine request ids, the `/generate` body and the error envelopes.

Read from SGLang 0.5.23's released source (docs/sglang-http-api.md), not from a running SGLang.
Three facts of that surface shape this module:

* **Unknown `sampling_params` keys are errors** (the contract gate answers 400 `{"error":
  "unknown field `k`, …"}`, entrypoints/http_server.py 937-939), so every
  neutral knob is translated through `SAMPLING_NAMES`; a knob missing there is refused as the
  caller's error naming it (`EngineRejected` with the knob's neutral name), never dropped or sent.
* **Defaults differ from vLLM's**: `max_new_tokens` defaults to 128 (an explicit null means "up to
  the context"), so the budget is always sent, null included.
* **Aborts match rids by prefix** (the scheduler's `req.rid.startswith(rid)`), so rids must be
  prefix-free: the domain's call ids are (`engine_request_id`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

import orjson

from rollout_grpc.server.domain import params as params_mod
from rollout_grpc.server.domain.model import MultimodalFeatures
from rollout_grpc.server.engines.api import (
    EngineCall,
    EngineError,
    EngineRejected,
    EngineRequestFailed,
)

#: Neutral knob name (`params.KNOBS` engine names, vLLM's spelling) -> SGLang's `sampling_params` key.
SAMPLING_NAMES: Final[dict[str, str]] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "no_stop_trim",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "seed": "sampling_seed",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
}
#: SGLang key -> neutral name, for an error message that names a key (`top_p must be in ...`).
_NEUTRAL: Final = {
    **{sglang: neutral for neutral, sglang in SAMPLING_NAMES.items()},
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "input_ids": "prompt",
    "top_logprobs_num": "logprobs",
}
#: `SamplingParams.verify` messages start with the key; FastAPI's name `body.<field>`.
_LEADING_KEY = re.compile(r"^(?:sampling_params\.)?([a-z_]+)\b")
_BODY_FIELD = re.compile(r"body\.(?:sampling_params\.)?([a-z_]+)")
_UNEXPECTED_KEY = re.compile(r"unexpected keyword argument '([a-z_]+)'")
#: The contract gate's serde-style messages (`unknown field `k`, expected one of …`).
_UNKNOWN_FIELD = re.compile(r"^unknown field `([a-z_]+)`")
#: Messages about the prompt (`input_ids cannot be empty.`, too long for the tokenizer or, within
#: six tokens of the context, for the scheduler: `Input length (…) exceeds the maximum allowed
#: length`, docs/sglang-http-api.md §2.1).
_PROMPT_WORDS: Final = ("The input ", "input_ids", "Either text, input_ids", "Input length ")


def engine_request_id(call_id: str) -> str:
    """The `rid` SGLang knows the call `call_id` by (what `/abort_request` takes): the call id as is.

    SGLang uses a client's rid verbatim and its scheduler aborts **by prefix**; the domain's call
    ids (`EngineCall.call_id`: unique per replica, owner, request id and attempt) hold exactly three
    `~` and end with one, so no call id is a prefix of another and an abort reaches exactly one call.
    The one place the rid scheme lives.
    """
    return call_id


def sampling_params(call: EngineCall, url: str = "") -> dict[str, Any]:
    """SGLang `sampling_params` for one call: the neutral knobs renamed, the budget always sent.

    A neutral knob SGLang has no key for raises `EngineRejected` naming it (INVALID_ARGUMENT on
    that field for the caller): sending it would be a 400 (or, in some builds, a 500) from
    `SamplingParams(**kwargs)`, and dropping it would change the sampling silently.
    """
    out: dict[str, Any] = {}
    for neutral, value in params_mod.engine_sampling_params(call.sampling).items():
        name = SAMPLING_NAMES.get(neutral)
        if name is None:
            raise EngineRejected(url, f"SGLang has no sampling parameter for {neutral}", neutral)
        out[name] = value
    out["max_new_tokens"] = call.max_tokens  # None is sent: SGLang's default would be 128
    if call.min_tokens:
        out["min_new_tokens"] = call.min_tokens
    if call.stream_interval > 1:
        out["stream_interval"] = call.stream_interval
    return out


def collapse_media(
    tokens: Sequence[int], features: MultimodalFeatures, url: str = ""
) -> tuple[list[int], list[str]]:
    """`input_ids` with every media item's placeholder run collapsed to one placeholder token, and
    the items' `image_data`, in placeholder order.

    SGLang expands placeholders itself from the images it is given (`image_data`); it takes no
    pre-computed tensors. So each item must carry its image as a URL or `data:` URI (bytes in
    `kwargs_data`), and the expanded run the sample holds goes back to the single placeholder the
    processor expands (docs/sglang-http-api.md §9: its expansion must agree with the sample's).
    """
    items = sorted((it for items in features.modalities.values() for it in items), key=lambda it: it.offset)
    ids: list[int] = []
    images: list[str] = []
    cursor = 0
    for item in items:
        if item.kwargs_data is None:
            raise EngineRejected(
                url,
                "SGLang takes images, not cached media: every media item needs its image (a URL or a "
                "data: URI) in kwargs_data",
                "prompt",
            )
        ids += tokens[cursor : item.offset]
        ids.append(item.placeholder_token_id)
        images.append(item.kwargs_data.decode("utf-8", "replace"))
        cursor = item.offset + item.length
    ids += tokens[cursor:]
    return ids, images


def truncating_knob(call: EngineCall) -> str | None:
    """The sampling knob that truncates the distribution before sampling (SGLang's logprobs are
    not renormalised after it), or None."""
    p = call.sampling
    if p.top_p is not None and p.top_p < 1.0:
        return "top_p"
    if p.top_k is not None and p.top_k > 0:
        return "top_k"
    if p.min_p is not None and p.min_p > 0.0:
        return "min_p"
    return None


def generate_body(url: str, call: EngineCall, context_length: int | None = None) -> dict[str, Any]:
    """The `/generate` body of one call (one prompt, one sample, always streamed with logprobs).

    With the engine's `context_length` known, the budget is capped at the room the prompt leaves:
    SGLang 0.5.23 refuses `prompt + max_new_tokens > context` (400, docs/sglang-http-api.md §2.2)
    where vLLM ends the output `length` at the context, and the domain sends the sample's whole
    remaining budget. Capped, both engines end such a call `length`: vLLM at the context, SGLang's
    scheduler two tokens short of it (`max_req_len - prompt - 1`, docs/sglang-http-api.md §2.2).

    With images, `return_prompt_token_ids` asks for the ids the engine really runs: SGLang's
    multimodal processors can decode `input_ids` to text and tokenize again, depending on the model
    and the server's environment (docs/sglang-http-api.md §1a #3), and `stream.ChunkReader` fails
    the call loudly when those differ from the sample's.
    """
    input_ids = call.prompt_token_ids
    body: dict[str, Any] = {"rid": engine_request_id(call.call_id)}
    if call.features:
        input_ids, body["image_data"] = collapse_media(input_ids, call.features, url)
        body["return_prompt_token_ids"] = True
    body["input_ids"] = input_ids
    body["sampling_params"] = sampling_params(call, url)
    if context_length is not None:
        _cap_to_context(body["sampling_params"], context_length - len(call.prompt_token_ids))
    body["return_logprob"] = True
    if call.top_logprobs:
        body["top_logprobs_num"] = call.top_logprobs
    body["stream"] = True
    if call.return_routed_experts:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = call.routed_experts_start
    return body


def _cap_to_context(params: dict[str, Any], room: int) -> None:
    """Lower `max_new_tokens` (and `min_new_tokens` with it, which must not exceed it) to `room`.
    A null budget is left to SGLang, which caps it at the context itself."""
    budget = params.get("max_new_tokens")
    if budget is None or budget <= room:
        return
    params["max_new_tokens"] = max(room, 0)
    if params.get("min_new_tokens", 0) > params["max_new_tokens"]:
        params["min_new_tokens"] = params["max_new_tokens"]


def neutral_param(message: str) -> str | None:
    """The neutral name of the field an SGLang error message is about, when it names one.

    SGLang's errors carry no `param`: `verify` messages start with the key (`top_p must be in
    (0, 1], got 2.0.`), FastAPI's name `body.<field>`, `SamplingParams(**kwargs)` quotes the key.
    """
    for pattern in (_UNKNOWN_FIELD, _UNEXPECTED_KEY, _BODY_FIELD):
        found = pattern.search(message)
        if found:
            return _NEUTRAL.get(found.group(1), found.group(1))
    if message.startswith(_PROMPT_WORDS):
        return "prompt"
    found = _LEADING_KEY.match(message)
    if found and found.group(1) in _NEUTRAL:
        return _NEUTRAL[found.group(1)]
    return None


def error_message(body: bytes) -> str:
    """The message of any SGLang envelope (`{"error":{"message"}}`, the contract gate's
    `{"error": "<text>"}`, the flat `{"object":"error","message"}`), FastAPI's `{"detail"}`, or
    the body's text."""
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            return str(error.get("message", ""))
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if isinstance(parsed.get(key), str):
                return str(parsed[key])
    return body.decode("utf-8", "replace")[:500] if body else ""


def rejection(url: str, status: int, message: str) -> EngineError:
    """An SGLang error status and message as the neutral error."""
    message = message or f"HTTP {status}"
    if status == 404:
        return EngineRejected(url, message, neutral_param(message), not_found=True)
    if 400 <= status < 500:
        return EngineRejected(url, message, neutral_param(message))
    return EngineRequestFailed(url, f"HTTP {status}: {message}")


def http_error(url: str, status: int, body: bytes) -> EngineError:
    """An HTTP error answer of SGLang as the neutral error."""
    return rejection(url, status, error_message(body))
