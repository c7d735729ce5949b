"""SGLang ``sampling_params`` (``python/sglang/srt/sampling/sampling_params.py``) mapped onto the
simulator's shared ``ToySampling``, with SGLang's defaults and ``verify`` messages
(``docs/sglang-http-api.md`` §2.3).

The differences from vLLM that a client trips over are kept: ``max_new_tokens`` defaults to 128
(explicit ``null`` = up to the context), ``top_k`` ``-1`` disables and ``0`` is an error, a
temperature below 1e-6 means greedy, ``skip_special_tokens`` defaults to true, ``no_stop_trim``
keeps the stop text, and **an unknown key or a value of the wrong type is an error**: SGLang
0.5.23's JSON contract gate (``contract``; ``entrypoints/http_server.py`` 937-939,
``api/v1/api_types.py`` 97-108 and 1256-1320) answers 400 with the bare-string envelope
``{"error": "unknown field `k`, expected one of …"}`` or ``{"error": "invalid type: …, expected
f64"}``, before any stream opens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..params import ToySampling
from .contract import check
from .errors import SGLangError

DEFAULT_MAX_NEW_TOKENS = 128
GREEDY_BELOW = 1e-6
TOP_K_ALL = 1 << 30

_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_INTS = ("top_k", "min_new_tokens", "n")
_OPT_INTS = ("max_new_tokens", "sampling_seed", "stream_interval")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_OTHER = ("stop", "stop_token_ids", "logit_bias")
#: Keys SGLang accepts that constrain decoding in ways a toy model cannot honour; the simulator
#: rejects them rather than silently ignoring them.
UNSUPPORTED = (
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "stop_regex",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
KNOWN = frozenset((*_FLOATS, *_INTS, *_OPT_INTS, *_BOOLS, *_OTHER, *UNSUPPORTED))


@dataclass(slots=True)
class SGLangSampling:
    """The shared parameters plus what only SGLang's output needs."""

    params: ToySampling
    #: ``max_new_tokens`` as sent (``None`` = no limit but the context); it is what
    #: ``finish_reason.length`` reports.
    max_new_tokens: int | None


def parse_sampling_params(raw: Any, vocab_size: int) -> SGLangSampling:
    """Decode, default and ``verify`` one ``sampling_params`` object."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SGLangError(f"sampling_params must be an object, got {raw!r}.")
    check(raw)  # the contract gate: unknown keys and value types, before anything else
    for name in UNSUPPORTED:
        if raw.get(name) is not None:
            raise SGLangError(f"sampling_params.{name} is not supported by the simulated engine.")
    sp = ToySampling()
    values: dict[str, Any] = {}
    # Past the gate every value has its type (null: the default).
    for name in _FLOATS:
        if raw.get(name) is not None:
            values[name] = float(raw[name])
    for name in (*_INTS, *_OPT_INTS, *_BOOLS):
        if raw.get(name) is not None:
            values[name] = raw[name]
    max_new = values.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS if "max_new_tokens" not in raw else None)
    temperature = values.get("temperature", 1.0)
    top_p = values.get("top_p", 1.0)
    top_k = values.get("top_k", TOP_K_ALL)
    min_p = values.get("min_p", 0.0)
    min_new = values.get("min_new_tokens", 0)
    # SamplingParams.verify, in SGLang's order
    if not math.isfinite(temperature) or temperature < 0.0:
        raise SGLangError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise SGLangError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise SGLangError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 and top_k != -1:
        raise SGLangError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        v = values.get(name, 0.0)
        if not -2.0 <= v <= 2.0:
            raise SGLangError(f"{name} must be in [-2, 2], got {v}.")
    rep = values.get("repetition_penalty", 1.0)
    if not 0.0 < rep <= 2.0:
        raise SGLangError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rep}.")
    if max_new is not None and max_new < 0:
        raise SGLangError(f"max_new_tokens must be at least 0, got {max_new}.")
    if min_new < 0 or (max_new is not None and min_new > max_new):
        raise SGLangError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    if values.get("n", 1) != 1:
        raise SGLangError("n > 1 is not supported by the simulated engine (send one request per sample).")
    sp.logit_bias = _logit_bias(raw.get("logit_bias"), vocab_size)
    sp.stop = _stop(raw.get("stop"))
    sp.stop_token_ids = _stop_ids(raw.get("stop_token_ids"))
    # temperature < 1e-6 becomes top_k=1 (greedy); the shared sampler's greedy is temperature 0
    sp.temperature = 0.0 if temperature < GREEDY_BELOW else temperature
    sp.top_p = top_p
    sp.top_k = 0 if top_k in (-1, TOP_K_ALL) or top_k >= vocab_size else top_k
    sp.min_p = min_p
    sp.frequency_penalty = values.get("frequency_penalty", 0.0)
    sp.presence_penalty = values.get("presence_penalty", 0.0)
    sp.repetition_penalty = rep
    sp.min_tokens = min_new
    sp.max_tokens = max_new
    sp.seed = values.get("sampling_seed")
    sp.stream_interval = values.get("stream_interval")
    sp.ignore_eos = values.get("ignore_eos", False)
    sp.skip_special_tokens = values.get("skip_special_tokens", True)
    sp.spaces_between_special_tokens = values.get("spaces_between_special_tokens", True)
    sp.include_stop_str_in_output = values.get("no_stop_trim", False)
    return SGLangSampling(sp, max_new)


def _logit_bias(raw: Any, vocab_size: int) -> dict[int, float] | None:
    if raw is None:
        return None
    out: dict[int, float] = {}
    for k, v in raw.items():
        try:
            tid = int(k)
        except ValueError:
            tid = -1
        if not 0 <= tid < vocab_size:
            raise SGLangError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {k}.")
        out[tid] = float(v)
    return out


def _stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [raw] if raw else []
    return [s for s in raw if s]  # a list of strings (the gate)


def _stop_ids(raw: Any) -> list[int]:
    if raw is None:
        return []
    return list(dict.fromkeys(raw))  # integers (the gate)
