"""Parsing of SGLang's ``POST /generate`` body (``GenerateReqInput`` in
``python/sglang/srt/managers/io_struct.py``; ``docs/sglang-http-api.md`` §2).

Type errors on fields FastAPI checks are ``SGLangValidationError`` (flat 400 envelope); what
SGLang's normalisation and ``TokenizerManager`` reject is ``SGLangError`` (``{"error":…}``). Unknown
top-level keys are ignored, as SGLang does. Batch input and ``n > 1`` are refused with a message
saying so: the simulator serves one sample per request.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from .errors import SGLangError, SGLangValidationError
from .params import SGLangSampling, parse_sampling_params

BATCH_UNSUPPORTED = "Batch input is not supported by the simulated engine (send one prompt per request)."


@dataclass(slots=True)
class SGLangRequest:
    """A parsed ``/generate`` call (one prompt, one sample)."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SGLangSampling
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    stream: bool
    return_routed_experts: bool
    routed_experts_start_len: int
    return_prompt_token_ids: bool
    image_data: list[str]


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise SGLangValidationError(name, f"Input should be a valid boolean, got {v!r}")
    return v


def _int(body: dict[str, Any], name: str, default: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise SGLangValidationError(name, f"Input should be a valid integer, got {v!r}")
    return v


def _input_ids(v: Any) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, (int, list)) and not isinstance(t, bool) for t in v):
        raise SGLangValidationError("input_ids", "Input should be a list of integers or a list of lists")
    if any(isinstance(t, list) for t in v):
        raise SGLangError(BATCH_UNSUPPORTED)
    return list(v)


def _image_data(v: Any) -> list[str]:
    """One image, a flat list of images (one request), or ``[]``/``null`` for none."""
    if v is None:
        return []
    items = v if isinstance(v, list) else [v]
    if any(isinstance(i, list) for i in items):
        raise SGLangError(BATCH_UNSUPPORTED)
    if not all(isinstance(i, str) for i in items):
        raise SGLangValidationError("image_data", "images must be URL or base64 strings")
    return list(items)


def parse_generate(body: Any, vocab_size: int) -> SGLangRequest:
    """Field checks in the order a client meets them (FastAPI first, then normalisation)."""
    if not isinstance(body, dict):
        raise SGLangValidationError("", "Input should be a valid dictionary")
    text = body.get("text")
    if text is not None and not isinstance(text, str):
        if isinstance(text, list):
            raise SGLangError(BATCH_UNSUPPORTED)
        raise SGLangValidationError("text", f"Input should be a valid string, got {text!r}")
    input_ids = _input_ids(body.get("input_ids"))
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise SGLangValidationError("rid", f"Input should be a valid string, got {rid!r}")
    stream = _bool(body, "stream")
    return_logprob = _bool(body, "return_logprob")
    logprob_start_len = _int(body, "logprob_start_len", -1)
    top_logprobs_num = _int(body, "top_logprobs_num", 0)
    return_routed = _bool(body, "return_routed_experts")
    routed_start = _int(body, "routed_experts_start_len", 0)
    text_in_lp = _bool(body, "return_text_in_logprobs")
    prompt_ids = _bool(body, "return_prompt_token_ids")
    images = _image_data(body.get("image_data"))
    # GenerateReqInput.normalize_batch_and_arguments
    if text is None and input_ids is None:
        raise SGLangError("Either text, input_ids or input_embeds should be provided.")
    if input_ids is not None and not input_ids:
        raise SGLangError("input_ids cannot be empty.")
    sampling = parse_sampling_params(body.get("sampling_params"), vocab_size)
    return SGLangRequest(
        rid=rid if rid is not None else uuid.uuid4().hex,
        text=text,
        input_ids=input_ids,
        sampling=sampling,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=text_in_lp,
        stream=stream,
        return_routed_experts=return_routed,
        routed_experts_start_len=routed_start,
        return_prompt_token_ids=prompt_ids,
        image_data=images,
    )
