"""Sampling knobs: ONE table drives conversion, validation, the engine translation and error mapping.

Each `Knob` names a `rollout.v1.SamplingParams` field (the same name on the domain dataclass), the
engine-side name (vLLM's `SamplingParams` spelling, the de-facto vocabulary engines share; None
when the domain resolves it per call, like the remaining budget), a check, and the rollout
default sent when the caller left it unset. `convert.py` converts by walking the table,
`validate` runs its checks, an engine adapter translates with `engine_sampling_params`, and
`field_for_engine_param` maps an engine's error `param` back to our field. A test walks the proto
descriptor and fails for a field missing here. Adding a knob: the proto, the domain dataclass
and one row here (its alias column says what the OpenAI door reads).

Validation mirrors what vLLM 0.32 would reject (so the caller gets INVALID_ARGUMENT naming *our*
field before any engine call); nothing is silently dropped — `repetition_penalty` and
`min_new_tokens`, which vime drops, are forwarded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.model import SamplingParams

#: vLLM's default `--max-logprobs`.
MAX_TOP_LOGPROBS = 20
_P = "sampling_params."

#: A check returns None when the value is fine, else (sub-field suffix, description).
Check = Callable[[Any], tuple[str, str] | None]


@dataclass(frozen=True, slots=True)
class Knob:
    """One sampling knob."""

    name: str
    #: The engine-side name; None when the domain resolves it per engine call.
    engine: str | None
    check: Check | None = None
    #: Sent when the caller left the knob unset (slime's rollout defaults); None sends nothing.
    default: Any = None
    #: The engine-side value of a set knob (identity when None); returning None omits it.
    to_engine: Callable[[Any], Any] | None = None
    #: The alias column: the names the OpenAI door reads for this knob (OpenAI's and vLLM's
    #: chat-completions spelling). Errors name the first; when a request sets several, the last
    #: wins (`max_completion_tokens`, OpenAI's newer name, over `max_tokens`). Empty: the OpenAI
    #: door does not offer the knob, and `front/openai/protocol.NOT_OFFERED` says why.
    openai: tuple[str, ...] = ()


def _finite(value: float) -> tuple[str, str] | None:
    return None if math.isfinite(value) else ("", f"must be a finite number, got {value}")


def _range(low: float, high: float, *, open_low: bool = False) -> Check:
    def check(value: float) -> tuple[str, str] | None:
        bad = _finite(value)
        if bad:
            return bad
        ok = (low < value if open_low else low <= value) and value <= high
        bracket = "(" if open_low else "["
        return None if ok else ("", f"must be in {bracket}{low:g}, {high:g}], got {value}")

    return check


def _temperature(value: float) -> tuple[str, str] | None:
    return _finite(value) or (None if value >= 0 else ("", f"must be non-negative, got {value}"))


def _top_k(value: int) -> tuple[str, str] | None:
    return None if value >= -1 else ("", f"must be -1, 0 (off) or positive, got {value}")


def _at_least(low: int) -> Check:
    def check(value: int) -> tuple[str, str] | None:
        word = "non-negative" if low == 0 else f"at least {low}"
        return None if value >= low else ("", f"must be {word}, got {value}")

    return check


def _positive(value: float) -> tuple[str, str] | None:
    return _finite(value) or (None if value > 0 else ("", f"must be positive, got {value}"))


def _token_ids(values: list[int]) -> tuple[str, str] | None:
    for i, tid in enumerate(values):
        if tid < 0:
            return f"[{i}]", f"must be non-negative, got {tid}"
    return None


def _stops(values: list[str]) -> tuple[str, str] | None:
    for i, text in enumerate(values):
        if not text:
            return f"[{i}]", "must not be empty"
    return None


def _logit_bias(values: dict[int, float]) -> tuple[str, str] | None:
    for tid, bias in values.items():
        if tid < 0:
            return "", f"token id must be non-negative, got {tid}"
        if not math.isfinite(bias):
            return "", f"bias of token {tid} must be finite, got {bias}"
    return None


def _top_logprobs(value: int) -> tuple[str, str] | None:
    ok = 0 <= value <= MAX_TOP_LOGPROBS
    return None if ok else ("", f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")


KNOBS: Final[tuple[Knob, ...]] = (
    Knob("temperature", "temperature", _temperature, openai=("temperature",)),
    Knob("top_p", "top_p", _range(0, 1, open_low=True), openai=("top_p",)),
    Knob("top_k", "top_k", _top_k, to_engine=lambda v: v or None, openai=("top_k",)),  # 0: off, not sent
    Knob("min_p", "min_p", _range(0, 1), openai=("min_p",)),
    # sent as the remaining budget, `max_tokens`
    Knob("max_new_tokens", None, _at_least(1), openai=("max_tokens", "max_completion_tokens")),
    # sent as what is still owed, `min_tokens`
    Knob("min_new_tokens", None, _at_least(0), openai=("min_tokens",)),
    Knob("stop", "stop", _stops, to_engine=lambda v: list(v) or None, openai=("stop",)),
    Knob(
        "stop_token_ids",
        "stop_token_ids",
        _token_ids,
        to_engine=lambda v: list(v) or None,
        openai=("stop_token_ids",),
    ),
    Knob("ignore_eos", "ignore_eos", openai=("ignore_eos",)),
    Knob("skip_special_tokens", "skip_special_tokens", default=False, openai=("skip_special_tokens",)),
    Knob("no_stop_trim", "include_stop_str_in_output", default=True, openai=("include_stop_str_in_output",)),
    Knob(
        "spaces_between_special_tokens",
        "spaces_between_special_tokens",
        default=False,
        openai=("spaces_between_special_tokens",),
    ),
    Knob("seed", "seed", openai=("seed",)),
    Knob("repetition_penalty", "repetition_penalty", _positive, openai=("repetition_penalty",)),
    Knob("presence_penalty", "presence_penalty", _range(-2, 2), openai=("presence_penalty",)),
    Knob("frequency_penalty", "frequency_penalty", _range(-2, 2), openai=("frequency_penalty",)),
    Knob(
        "logit_bias",
        "logit_bias",
        _logit_bias,
        to_engine=lambda v: {str(k): b for k, b in v.items()} or None,
        openai=("logit_bias",),
    ),
    Knob("top_logprobs", None, _top_logprobs),  # sent per call as `logprobs` (always requested)
)

#: Engine error `param`s that are not a knob's engine name -> our field.
_ENGINE_PARAM_FIELDS: Final = {
    "max_tokens": _P + "max_new_tokens",
    "min_tokens": _P + "min_new_tokens",
    "logprobs": _P + "top_logprobs",
    "prompt": "sample.tokens",
    "model": "options.model",
}
_BY_ENGINE_NAME: Final = {k.engine: _P + k.name for k in KNOBS if k.engine is not None}


def openai_name(field: str) -> str:
    """The OpenAI door's name of our request field (`sampling_params.max_new_tokens` ->
    `max_tokens`, from the alias column); other fields unchanged, the prefix dropped."""
    name = field.removeprefix(_P)
    for knob in KNOBS:
        if knob.openai and (name == knob.name or name.startswith(knob.name + "[")):
            return knob.openai[0] + name[len(knob.name) :]
    return name


def field_for_engine_param(param: str | None, default: str) -> str:
    """Our request field for an engine's error `param` (neutral names, see `vllm._neutral_param`)."""
    if param is None:
        return default
    return _BY_ENGINE_NAME.get(param) or _ENGINE_PARAM_FIELDS.get(param, default)


def validate(params: SamplingParams, *, skip_text: bool) -> None:
    """Raise InvalidArgument for values vLLM would reject or that make no sense for a rollout."""
    for knob in KNOBS:
        value = getattr(params, knob.name)
        if knob.check is None or value is None:
            continue
        problem = knob.check(value)
        if problem is not None:
            raise InvalidArgument(_P + knob.name + problem[0], problem[1])
    if (
        params.min_new_tokens is not None
        and params.max_new_tokens is not None
        and params.min_new_tokens > params.max_new_tokens
    ):
        raise InvalidArgument(
            _P + "min_new_tokens",
            f"must not exceed max_new_tokens ({params.min_new_tokens} > {params.max_new_tokens})",
        )
    if params.top_logprobs and not skip_text:
        raise InvalidArgument(
            _P + "top_logprobs",
            "needs options.skip_text: vLLM returns the candidates' token ids only in tokens mode",
        )


def engine_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """The engine-side knobs of `params` (engine names), rollout defaults where unset.

    Per-call values (`max_tokens`, `min_tokens`, `logprobs`, ...) are added by the adapter.
    """
    out: dict[str, Any] = {}
    for knob in KNOBS:
        if knob.engine is None:
            continue
        value = getattr(params, knob.name)
        if value is None:
            value = knob.default
        elif knob.to_engine is not None:
            value = knob.to_engine(value)
        if value is not None:
            out[knob.engine] = value
    return out
