"""Sampling parameters from a plain dict: the one implementation behind both clients and the slime hook.

Keys are rollout.v1 `SamplingParams` field names (snake_case; the slime hook maps SGLang's names
onto them first). Each value is checked for its field's type here, so a typo or a wrong type is a
`ValueError` naming the key as the caller spelled it, raised before anything is sent (protobuf's
`json_format` would raise a `ParseError` listing the fields' camelCase JSON names instead).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rollout_grpc._proto import rollout_pb2 as pb


def _strict_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError
    return int(value)


def _set_int(out: pb.SamplingParams, field: str, value: Any) -> None:
    setattr(out, field, _strict_int(value))  # protobuf raises ValueError outside int32/int64


def _set_float(out: pb.SamplingParams, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError
    setattr(out, field, float(value))


def _set_bool(out: pb.SamplingParams, field: str, value: Any) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError
    setattr(out, field, bool(value))


def _set_stop(out: pb.SamplingParams, field: str, value: Any) -> None:
    stops = [value] if isinstance(value, str) else list(value)  # one string or a list, as in SGLang
    if not all(isinstance(s, str) for s in stops):
        raise TypeError
    out.stop.extend(stops)


def _set_stop_token_ids(out: pb.SamplingParams, field: str, value: Any) -> None:
    out.stop_token_ids.extend(_strict_int(t) for t in value)


def _set_logit_bias(out: pb.SamplingParams, field: str, value: Any) -> None:
    for token, bias in dict(value).items():  # token ids as ints or strings (JSON keys)
        out.logit_bias[int(token)] = float(bias)


#: SamplingParams field -> how a value is checked and set on it (TypeError or ValueError for a
#: value of the wrong type). tests/client/test_params.py checks it covers every field of the proto.
SETTERS: dict[str, Callable[[pb.SamplingParams, str, Any], None]] = {
    **dict.fromkeys(("top_k", "max_new_tokens", "min_new_tokens", "seed", "top_logprobs"), _set_int),
    **dict.fromkeys(
        ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"),
        _set_float,
    ),
    **dict.fromkeys(
        ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"), _set_bool
    ),
    "stop": _set_stop,
    "stop_token_ids": _set_stop_token_ids,
    "logit_bias": _set_logit_bias,
}

#: The clients' names: the fields themselves.
FIELD_NAMES: dict[str, str] = {name: name for name in SETTERS}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def sampling_params(
    values: Mapping[str, Any],
    *,
    names: Mapping[str, str] = FIELD_NAMES,
    unsupported: Mapping[str, str] | None = None,
    kind: str = "sampling param",
) -> pb.SamplingParams:
    """SamplingParams from a dict; a `None` value means "the default" (the key is left unset).

    `names` maps the caller's keys to fields (several keys may name one field, but only one of
    them may be given); `unsupported` refuses some keys with a reason; `kind` names the keys in
    messages ("slime sampling param"). Raises ValueError naming the key for an unknown or
    unsupported key, a value of the wrong type, or two keys setting the same field.
    """
    out = pb.SamplingParams()
    seen: dict[str, str] = {}
    for key, value in values.items():
        if value is None:
            continue
        if unsupported and key in unsupported:
            raise ValueError(f"{kind} {key!r} is not supported: {unsupported[key]}")
        field = names.get(key)
        if field is None:
            raise ValueError(_unknown(key, names, kind))
        if field in seen:
            raise ValueError(f"{kind}s {seen[field]!r} and {key!r} both set {field}")
        seen[field] = key
        try:
            SETTERS[field](out, field, value)
        except (TypeError, ValueError):
            raise ValueError(
                f"{kind} {key!r} has an invalid value {value!r} for rollout.v1 {field}"
            ) from None
    return out


def _unknown(key: str, names: Mapping[str, str], kind: str) -> str:
    hint = f" (did you mean {_snake(key)!r}?)" if _snake(key) in names and _snake(key) != key else ""
    return f"unknown {kind} {key!r}{hint}; supported: {', '.join(sorted(names))}"
