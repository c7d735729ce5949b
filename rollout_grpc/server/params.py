"""Sampling parameters: validation and translation to vLLM's `sampling_params`.

Validation mirrors what vLLM 0.32 would reject (so the caller gets INVALID_ARGUMENT naming *our*
field before any engine call), and translation follows the vLLM port of slime with its gaps closed:
nothing is silently dropped — `repetition_penalty` and `min_new_tokens`, which vime drops, are
forwarded.
"""

from __future__ import annotations

import math
from typing import Any

from rollout_grpc.server.domain import SamplingParams
from rollout_grpc.server.errors import InvalidArgument

#: vLLM's default `--max-logprobs`.
MAX_TOP_LOGPROBS = 20
_P = "sampling_params."


def _finite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise InvalidArgument(_P + name, f"must be a finite number, got {value}")


def validate(params: SamplingParams, *, skip_text: bool) -> None:
    """Raise InvalidArgument for values vLLM would reject or that make no sense for a rollout."""
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        _finite(name, getattr(params, name))
    if params.temperature is not None and params.temperature < 0:
        raise InvalidArgument(_P + "temperature", f"must be non-negative, got {params.temperature}")
    if params.top_p is not None and not 0 < params.top_p <= 1:
        raise InvalidArgument(_P + "top_p", f"must be in (0, 1], got {params.top_p}")
    if params.top_k is not None and params.top_k < -1:
        raise InvalidArgument(_P + "top_k", f"must be -1, 0 (off) or positive, got {params.top_k}")
    if params.min_p is not None and not 0 <= params.min_p <= 1:
        raise InvalidArgument(_P + "min_p", f"must be in [0, 1], got {params.min_p}")
    if params.max_new_tokens is not None and params.max_new_tokens < 1:
        raise InvalidArgument(_P + "max_new_tokens", f"must be at least 1, got {params.max_new_tokens}")
    if params.min_new_tokens is not None and params.min_new_tokens < 0:
        raise InvalidArgument(_P + "min_new_tokens", f"must be non-negative, got {params.min_new_tokens}")
    if (
        params.min_new_tokens is not None
        and params.max_new_tokens is not None
        and params.min_new_tokens > params.max_new_tokens
    ):
        raise InvalidArgument(
            _P + "min_new_tokens",
            f"must not exceed max_new_tokens ({params.min_new_tokens} > {params.max_new_tokens})",
        )
    if params.repetition_penalty is not None and params.repetition_penalty <= 0:
        raise InvalidArgument(_P + "repetition_penalty", f"must be positive, got {params.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if value is not None and not -2 <= value <= 2:
            raise InvalidArgument(_P + name, f"must be in [-2, 2], got {value}")
    for i, tid in enumerate(params.stop_token_ids):
        if tid < 0:
            raise InvalidArgument(f"{_P}stop_token_ids[{i}]", f"must be non-negative, got {tid}")
    for i, text in enumerate(params.stop):
        if not text:
            raise InvalidArgument(f"{_P}stop[{i}]", "must not be empty")
    for tid, bias in params.logit_bias.items():
        if tid < 0:
            raise InvalidArgument(_P + "logit_bias", f"token id must be non-negative, got {tid}")
        if not math.isfinite(bias):
            raise InvalidArgument(_P + "logit_bias", f"bias of token {tid} must be finite, got {bias}")
    if params.top_logprobs is not None:
        if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                _P + "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs}"
            )
        if params.top_logprobs > 0 and not skip_text:
            raise InvalidArgument(
                _P + "top_logprobs",
                "needs options.skip_text: vLLM returns the candidates' token ids only in tokens mode",
            )


def to_vllm(params: SamplingParams, *, max_tokens: int | None, min_tokens: int | None) -> dict[str, Any]:
    """vLLM `sampling_params` for one engine call; `max_tokens` is the remaining budget.

    Rollout defaults (slime): `include_stop_str_in_output` true, `skip_special_tokens` false,
    `spaces_between_special_tokens` false. `logprobs` is always requested so that every token
    comes back with its logprob (0 asks for the sampled token only).
    """
    sp: dict[str, Any] = {
        "logprobs": params.top_logprobs or 0,
        "include_stop_str_in_output": True if params.no_stop_trim is None else params.no_stop_trim,
        "skip_special_tokens": False if params.skip_special_tokens is None else params.skip_special_tokens,
        "spaces_between_special_tokens": (
            False if params.spaces_between_special_tokens is None else params.spaces_between_special_tokens
        ),
    }
    if max_tokens is not None:
        sp["max_tokens"] = max_tokens
    if min_tokens:
        sp["min_tokens"] = min_tokens
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
    ):
        value = getattr(params, name)
        if value is not None:
            sp[name] = value
    if params.top_k is not None and params.top_k != 0:
        sp["top_k"] = params.top_k
    if params.stop:
        sp["stop"] = list(params.stop)
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    if params.logit_bias:
        sp["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return sp


#: vLLM's error `param` -> our field, so that an engine-side rejection still names the caller's field.
VLLM_PARAM_TO_FIELD: dict[str, str] = {
    "temperature": _P + "temperature",
    "top_p": _P + "top_p",
    "top_k": _P + "top_k",
    "min_p": _P + "min_p",
    "max_tokens": _P + "max_new_tokens",
    "min_tokens": _P + "min_new_tokens",
    "logprobs": _P + "top_logprobs",
    "seed": _P + "seed",
    "stop": _P + "stop",
    "stop_token_ids": _P + "stop_token_ids",
    "logit_bias": _P + "logit_bias",
    "repetition_penalty": _P + "repetition_penalty",
    "presence_penalty": _P + "presence_penalty",
    "frequency_penalty": _P + "frequency_penalty",
    "body.token_ids": "sample.tokens",
    "model": "options.model",
}
