"""``sampling_params`` parsing and validation with vLLM's rules and messages.

vLLM decodes ``sampling_params`` with msgspec (unknown keys ignored, ints accepted for floats) and
then runs vLLM's ``SamplingParams.__post_init__``/``_verify_args``; the messages below follow that code
(reference §3.2, §3.7) because clients surface them to users.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError, bad_request, validation_error

MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
SAMPLING_EPS = 1e-5
MAX_TEMP_FLOOR = 1e-2

_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)
_INT_FIELDS = ("n", "top_k", "min_tokens", "routed_experts_prompt_start")
_OPT_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "stream_interval")
_BOOL_FIELDS = (
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


@dataclass(slots=True)
class ToySampling:
    """The subset of vLLM's ``SamplingParams`` the simulator honours (defaults as vLLM's)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream_interval: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    routed_experts_prompt_start: int = 0
    max_tokens_given: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _msgspec_error(expected: str, got: Any, path: str, body: dict[str, Any]) -> ApiError:
    """msgspec's decode error surfaced through pydantic (approximation; vLLM wraps it)."""
    got_name = _json_type(got)
    msg = f"Value error, Expected `{expected}`, got `{got_name}` - at `$.{path}`"
    return validation_error(
        [
            {
                "type": "value_error",
                "loc": "body.sampling_params",
                "msg": msg,
                "input": body,
                "ctx": "{'error': ValueError(" + repr(msg.removeprefix("Value error, ")) + ")}",
            }
        ]
    )


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "array"
    return "object"


def parse_sampling_params(raw: Any) -> ToySampling:
    """Decode and validate; raises ``ApiError`` with vLLM's envelope and message."""
    if not isinstance(raw, dict):
        raise validation_error(
            [
                {
                    "type": "dict_type" if not isinstance(raw, str) else "model_attributes_type",
                    "loc": "body.sampling_params",
                    "msg": "Input should be a valid dictionary or instance of SamplingParams",
                    "input": raw,
                }
            ]
        )
    sp = ToySampling()
    for name in _FLOAT_FIELDS:
        if name in raw and raw[name] is not None:
            v = raw[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _msgspec_error("float", v, name, raw)
            setattr(sp, name, float(v))
    for name in _INT_FIELDS:
        if name in raw and raw[name] is not None:
            v = raw[name]
            if isinstance(v, bool) or not isinstance(v, int):
                raise _msgspec_error("int", v, name, raw)
            setattr(sp, name, v)
    for name in _OPT_INT_FIELDS:
        if name in raw:
            v = raw[name]
            if name in ("logprobs", "prompt_logprobs") and v is True:
                v = 1
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise _msgspec_error("int | null", v, name, raw)
            setattr(sp, name, v)
    for name in _BOOL_FIELDS:
        if name in raw and raw[name] is not None:
            v = raw[name]
            if not isinstance(v, bool):
                raise _msgspec_error("bool", v, name, raw)
            setattr(sp, name, v)
    sp.max_tokens_given = raw.get("max_tokens") is not None
    stop = raw.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            sp.stop = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            sp.stop = list(stop)
        else:
            raise _msgspec_error("str | array | null", stop, "stop", raw)
    sti = raw.get("stop_token_ids")
    if sti is not None:
        if not isinstance(sti, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in sti):
            raise _msgspec_error("array | null", sti, "stop_token_ids", raw)
        sp.stop_token_ids = list(dict.fromkeys(sti))
    bw = raw.get("bad_words")
    if bw is not None:
        if not isinstance(bw, list) or not all(isinstance(s, str) for s in bw):
            raise _msgspec_error("array | null", bw, "bad_words", raw)
        sp.bad_words = list(dict.fromkeys(bw))
    lb = raw.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise _msgspec_error("object | null", lb, "logit_bias", raw)
        bias: dict[int, float] = {}
        invalid: list[Any] = []
        for k, v in lb.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                invalid.append(k)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _msgspec_error("float", v, f"logit_bias.{k}", raw)
            bias[tid] = min(100.0, max(-100.0, float(v)))
        if invalid:
            raise bad_request(
                "logit_bias contains key(s) that cannot be converted to integer token IDs: " + repr(invalid),
                "logit_bias",
                invalid,
                has_value=True,
            )
        sp.logit_bias = bias
    for name in ("allowed_token_ids", "logprob_token_ids"):
        v = raw.get(name)
        if v is not None:
            if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise _msgspec_error("array | null", v, name, raw)
            setattr(sp, name, list(v))
    if raw.get("prompt_logprob_token_ids") is not None:
        raise bad_request(
            "prompt_logprob_token_ids requires the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1).",
            "prompt_logprob_token_ids",
        )
    _post_init(sp)
    return sp


def _post_init(sp: ToySampling) -> None:
    """vLLM's ``SamplingParams.__post_init__`` and ``_verify_args``, in vLLM's order."""
    if 0 < sp.temperature < MAX_TEMP_FLOOR:
        sp.temperature = MAX_TEMP_FLOOR
    if sp.seed == -1:
        sp.seed = None
    if sp.n < 1:
        raise bad_request(f"n must be at least 1, got {sp.n}.")
    if sp.n > MAX_N:
        raise bad_request(
            f"n must be at most {MAX_N}, got {sp.n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    if not -2.0 <= sp.presence_penalty <= 2.0:
        raise bad_request(f"presence_penalty must be in [-2, 2], got {sp.presence_penalty}.")
    if not -2.0 <= sp.frequency_penalty <= 2.0:
        raise bad_request(f"frequency_penalty must be in [-2, 2], got {sp.frequency_penalty}.")
    if not math.isfinite(sp.repetition_penalty):
        raise bad_request(f"repetition_penalty must be a finite number, got {sp.repetition_penalty}.")
    if sp.repetition_penalty <= 0.0:
        raise bad_request(f"repetition_penalty must be greater than zero, got {sp.repetition_penalty}.")
    t = sp.temperature
    if not math.isfinite(t):
        raise bad_request(f"temperature must be a finite number, got {t}.", "temperature", t, has_value=True)
    if t < 0.0:
        raise bad_request(f"temperature must be non-negative, got {t}.", "temperature", t, has_value=True)
    if t > 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {t}.", "temperature", t, has_value=True)
    if not 0.0 < sp.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {sp.top_p}.", "top_p", sp.top_p, has_value=True)
    if sp.top_k < -1:
        raise bad_request(f"top_k must be 0 (disable), or at least 1, got {sp.top_k}.")
    if not 0.0 <= sp.min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {sp.min_p}.")
    if sp.max_tokens is not None and sp.max_tokens < 1:
        raise bad_request(
            f"max_tokens must be at least 1, got {sp.max_tokens}.",
            "max_tokens",
            sp.max_tokens,
            has_value=True,
        )
    if sp.min_tokens < 0:
        raise bad_request(f"min_tokens must be greater than or equal to 0, got {sp.min_tokens}.")
    if sp.max_tokens is not None and sp.min_tokens > sp.max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={sp.max_tokens}, got {sp.min_tokens}."
        )
    if sp.stream_interval is not None and sp.stream_interval < 1:
        raise bad_request(
            f"stream_interval must be at least 1, got {sp.stream_interval}.",
            "stream_interval",
            sp.stream_interval,
            has_value=True,
        )
    if sp.logprobs is not None and sp.logprobs != -1 and sp.logprobs < 0:
        raise bad_request(
            f"logprobs must be non-negative or -1, got {sp.logprobs}.",
            "logprobs",
            sp.logprobs,
            has_value=True,
        )
    if sp.prompt_logprobs is not None and sp.prompt_logprobs != -1 and sp.prompt_logprobs < 0:
        raise bad_request(
            f"prompt_logprobs must be non-negative or -1, got {sp.prompt_logprobs}.",
            "prompt_logprobs",
            sp.prompt_logprobs,
            has_value=True,
        )
    if any(not s for s in sp.stop):
        raise bad_request("stop cannot contain an empty string.")
    if sp.stop and not sp.detokenize:
        raise bad_request(
            "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
        )
    if any(not w for w in sp.bad_words):
        raise bad_request(f"bad_words cannot contain an empty string. Got bad_words={sp.bad_words!r}")
    if sp.greedy:
        sp.top_p = 1.0
        sp.top_k = 0
        sp.min_p = 0.0
        if sp.n > 1:
            raise bad_request(f"n must be 1 when using greedy sampling, got {sp.n}.")
