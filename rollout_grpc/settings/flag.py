"""One flag of `serve`: its declaration (`Flag`), the field it fills, its parser, its bounds and
its default in the flag's unit. Everything else in the settings works on these.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from rollout_grpc.argtypes import MAX_PORT
from rollout_grpc.argtypes import number as ranged_number
from rollout_grpc.server.config import (
    FrontDoorConfig,
    ServerConfig,
)
from rollout_grpc.server.domain.model import GenerateOptions

ENV_PREFIX: Final = "ROLLOUT_GRPC_"


class SettingsError(ValueError):
    """A value from the environment or the config file is unusable; the message names it."""


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag.

    `field` names the `ServerConfig` field it sets ("default_options.x" for a `GenerateOptions`
    field, "openai.x" for a `FrontDoorConfig` one; "" for a flag of the command itself, whose
    default is `default`). A flag's value is
    the field's value times `scale` (milliseconds for a field in seconds). `zero_is_none` maps
    0 to None for fields where None means "off".
    """

    name: str
    help: str
    field: str = ""
    kind: str = "value"  # "value", "list" (repeatable), "switch" (store_true), "off-switch"
    type: Callable[[str], Any] | None = None
    scale: float = 1.0
    zero_is_none: bool = False
    choices: tuple[str, ...] | None = None
    default: Any = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    #: Turns the parsed value into the field's value (e.g. `NAME=ROLE` items into a dict).
    to_field: Callable[[Any], Any] | None = None

    @property
    def dest(self) -> str:
        """The argparse destination (flag name with underscores)."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        """The environment variable that may set this flag."""
        return ENV_PREFIX + self.dest.upper()


_TYPES: Final[dict[str, Callable[[str], Any]]] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list[str]": str,
}


#: Nested dataclasses of ServerConfig whose fields are flags ("default_options.x", "openai.x").
_NESTED: Final[dict[str, type[Any]]] = {"default_options": GenerateOptions, "openai": FrontDoorConfig}


def _field(path: str) -> dataclasses.Field[Any]:
    owner: type[Any] = ServerConfig
    outer, dot, inner = path.partition(".")
    if dot:
        owner, path = _NESTED[outer], inner
    by_name = {f.name: f for f in dataclasses.fields(owner)}
    return by_name[path]


def _field_default(path: str) -> Any:
    f = _field(path)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


#: Numeric flags whose value must be at least 1: a count of 0 would leave the service unable to
#: work at all (no generation admitted, no engine attempt, no room in a message).
AT_LEAST_ONE: Final = frozenset(
    {
        "--workers",
        "--server-concurrency",
        "--rollout-num-gpus",
        "--rollout-num-gpus-per-engine",
        "--max-engine-attempts",
        "--stream-batch-tokens",
        "--max-receive-message-mb",
        "--max-send-message-mb",
        "--max-control-request-bytes",
        "--openai-max-sessions-per-caller",
        "--openai-session-mb-per-caller",
    }
)
#: Numeric flags whose value must be above 0: deadlines, timeouts and intervals, where 0 would
#: expire at once or spin. (Rates and bursts take 0: their help says what it means.)
ABOVE_ZERO: Final = frozenset(
    {
        "--control-deadline",
        "--health-interval",
        "--engine-connect-timeout",
        "--engine-idle-timeout",
        "--keepalive-time",
        "--openai-body-timeout",
        "--openai-session-ttl-s",
        "--max-unrequested-time",
        "--weights-load-timeout",
        "--weights-lease-ttl",
        "--step-drain-lease-ttl-s",
    }
)
#: Port flags: 0 (any free port) to 65535.
PORTS: Final = frozenset({"--port", "--health-port", "--metrics-port", "--openai-port"})


def _in_range(flag: Flag, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` (int or float) that also refuses what no flag means: NaN, infinities, negative
    values, and the flag's own bounds (`AT_LEAST_ONE`, `ABOVE_ZERO`, `PORTS`); argparse prefixes
    the message with the flag, `_convert` with the source."""
    return ranged_number(
        parse,
        low=1 if flag.name in AT_LEAST_ONE else 0,
        above=flag.name in ABOVE_ZERO,
        high=MAX_PORT if flag.name in PORTS else None,
    )


def _flag_type(flag: Flag) -> Callable[[str], Any]:
    if flag.type is not None:
        parse = flag.type
    else:
        annotation = str(_field(flag.field).type).replace(" | None", "")
        parse = _TYPES.get(annotation, str)  # an enum (DriftPolicy) is parsed as its value, then to_field
    return _in_range(flag, parse) if parse in (int, float) else parse


def flag_default(flag: Flag) -> Any:
    """The flag's default value, in the flag's unit."""
    if not flag.field:
        return [] if flag.kind == "list" else flag.default
    value = _field_default(flag.field)
    if flag.kind == "off-switch":
        return not value
    if flag.kind == "list":
        return list(value or []) if flag.to_field is None else []
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    return value * flag.scale if flag.scale != 1.0 else value
