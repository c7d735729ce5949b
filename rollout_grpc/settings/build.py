"""The `ServerConfig` that parsed `serve` flags describe: each flag's value, back in the field's
unit, put in its field (or its nested config's).
"""

from __future__ import annotations

import argparse
from typing import Any

from rollout_grpc.server.config import (
    ServerConfig,
)
from rollout_grpc.settings.flag import _NESTED
from rollout_grpc.settings.table import FLAGS


def server_config(
    args: argparse.Namespace,
    engines: list[str],
    *,
    simulated: bool = False,
    kinds: dict[str, str] | None = None,
) -> ServerConfig:
    """The ServerConfig that the parsed flags describe (flags without a field are skipped);
    `kinds` maps the engine URLs that are not vLLM to their kind (`engine_kinds`)."""
    top: dict[str, Any] = {
        "engines": engines,
        "simulated_engines": simulated,
        "engine_kinds": dict(kinds or {}),
    }
    nested: dict[str, dict[str, Any]] = {name: {} for name in _NESTED}
    for flag in FLAGS:
        if not flag.field or flag.field == "engines":
            continue
        value = getattr(args, flag.dest)
        if flag.kind == "off-switch":
            value = not value
        elif flag.kind == "list":
            value = list(value)
            if flag.to_field is not None:
                value = flag.to_field(value)
        elif value is not None and flag.zero_is_none and value == 0:
            value = None
        elif value is not None and flag.scale != 1.0:
            value = value / flag.scale
        elif value is not None and flag.to_field is not None:
            value = flag.to_field(value)
        outer, dot, inner = flag.field.partition(".")
        if dot:
            nested[outer][inner] = value
        else:
            top[flag.field] = value
    return ServerConfig(**{name: _NESTED[name](**values) for name, values in nested.items()}, **top)
