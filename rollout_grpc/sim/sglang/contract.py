"""SGLang 0.5.23's JSON contract gate over ``sampling_params`` (``decode_SamplingParams``,
``api/v1/api_types.py`` 1259-1321): the keys in the body's order, the first unknown key or value of
the wrong type refused with serde's text (``unknown field `k`, expected one of …``, ``invalid
type: string "x", expected f64``), which names no key for a type. ``/generate`` answers it 400 with
the bare string (``entrypoints/http_server.py`` 937-939), before the tokenizer's ``verify``; null is
every field's default there.
"""

from __future__ import annotations

from typing import Any

from .errors import SGLangContractError

#: The contract's ``SamplingParams`` fields, in its order (``api/v1/api_types.py`` 1256): what
#: the unknown-field message lists.
CONTRACT_FIELDS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)

F64, I64, BOOL, STR = "f64", "i64", "a boolean", "a string"
#: What each field decodes as (``decode_SamplingParams``); ``None``: anything (``custom_params``,
#: and ``watermark``, whose struct the simulator refuses later as unsupported).
_KINDS: dict[str, str | None] = {
    "max_new_tokens": I64,
    "stop": "str_or_list",
    "stop_token_ids": "i64_list",
    "stop_regex": "str_or_list",
    "temperature": F64,
    "top_p": F64,
    "top_k": I64,
    "min_p": F64,
    "frequency_penalty": F64,
    "presence_penalty": F64,
    "repetition_penalty": F64,
    "min_new_tokens": I64,
    "n": I64,
    "json_schema": STR,
    "regex": STR,
    "ebnf": STR,
    "structural_tag": STR,
    "ignore_eos": BOOL,
    "skip_special_tokens": BOOL,
    "spaces_between_special_tokens": BOOL,
    "no_stop_trim": BOOL,
    "stream_interval": I64,
    "logit_bias": "f64_map",
    "sampling_seed": I64,
    "custom_params": None,
    "beam_width": I64,
    "watermark": None,
    "choice": "str_list",
}


def _unexpected(v: Any) -> str:
    """serde's ``Unexpected`` display, as the wheel writes it (``api/v1/api_types.py`` 30-46)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _is(v: Any, kind: str) -> bool:
    if kind == F64:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == I64:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == BOOL:
        return isinstance(v, bool)
    return isinstance(v, str)


def _invalid(v: Any, expected: str) -> SGLangContractError:
    return SGLangContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _value(v: Any, kind: str) -> None:
    """Raise the gate's error for one non-null value of ``kind``."""
    if kind in (F64, I64, BOOL, STR):
        if not _is(v, kind):
            raise _invalid(v, kind)
    elif kind == "str_or_list":  # decode_StringOrList (api/v1/api_types.py:946-949)
        if not isinstance(v, list):
            if not isinstance(v, str):
                raise _invalid(v, "a value or an array of values for StringOrList")
            return
        _seq(v, STR)
    elif kind == "i64_list":  # decode_Int64List (api/v1/api_types.py:1021-1022)
        _seq(v, I64)
    elif kind == "str_list":
        _seq(v, STR)
    elif kind == "f64_map":
        if not isinstance(v, dict):
            raise _invalid(v, "a map")
        for e in v.values():
            _value(e, F64)


def _seq(v: Any, kind: str) -> None:
    if not isinstance(v, list):
        raise _invalid(v, "a sequence")
    for e in v:
        _value(e, kind)


def check(raw: dict[str, Any]) -> None:
    """The gate over one ``sampling_params`` object: ``SGLangContractError`` at the first key, in
    the body's order, that is unknown or whose value has the wrong type."""
    for key, v in raw.items():
        if key not in _KINDS:
            listed = ", ".join(f"`{f}`" for f in CONTRACT_FIELDS)
            raise SGLangContractError(f"unknown field `{key}`, expected one of {listed}")
        kind = _KINDS[key]
        if v is not None and kind is not None:
            _value(v, kind)
