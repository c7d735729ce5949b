"""Where a flag's value comes from besides the command line: the environment (`ROLLOUT_GRPC_*`)
and a TOML file (`--config`), each converted to the flag's type with an error naming the source;
and the `ROLLOUT_GRPC_*` variables nothing reads (a misspelt setting is reported, never ignored).
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rollout_grpc.settings.flag import ENV_PREFIX, Flag, SettingsError, _flag_type
from rollout_grpc.settings.table import FLAGS

#: ROLLOUT_GRPC_* variables that are read elsewhere, hence no misspelling of a setting.
OTHER_VARIABLES: Final[dict[str, str]] = {
    ENV_PREFIX + "CONFIG": "serve --config",
    ENV_PREFIX + "TARGET": "the replica address of the clients' examples and of the slime hook",
    ENV_PREFIX + "ALLOW_UNTESTED_PYTHON": "the server's Python version check (server/environment.py)",
}
#: Families of ROLLOUT_GRPC_* variables read elsewhere: `rollout-grpc info`'s connection flags, the
#: slime hook's credentials.
OTHER_PREFIXES: Final = (ENV_PREFIX + "INFO_", ENV_PREFIX + "CLIENT_")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _convert(flag: Flag, raw: Any, source: str) -> Any:
    """A value from the environment (a string) or a TOML file (typed) in the flag's type."""
    try:
        if flag.kind in ("switch", "off-switch"):
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text not in _TRUE | _FALSE:
                raise ValueError(f"expected true or false, got {raw!r}")
            return text in _TRUE
        if flag.kind == "list":
            items = [str(v) for v in raw] if isinstance(raw, list) else str(raw).split(",")
            check = flag.type or str
            return [check(v.strip()) for v in items if v.strip()]
        if isinstance(raw, bool):
            raise ValueError(f"expected a {_flag_type(flag).__name__}, got {raw!r}")
        value = _flag_type(flag)(raw if isinstance(raw, str) else str(raw))
        if flag.choices and value not in flag.choices:
            raise ValueError(f"must be one of {', '.join(flag.choices)}, got {value!r}")
        return value
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise SettingsError(f"{source}: {flag.name}: {exc}") from exc


_BY_KEY: Final[dict[str, Flag]] = {
    key: flag
    for flag in FLAGS
    for key in (flag.dest, *(a.removeprefix("--").replace("-", "_") for a in flag.aliases))
}


def from_config_file(path: str) -> dict[str, Any]:
    """Flag values (by argparse dest) from a TOML file."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"config file {path}: {exc}") from exc
    values: dict[str, Any] = {}
    for key, raw in data.items():
        flag = _BY_KEY.get(key.replace("-", "_"))
        if flag is None:
            close = difflib.get_close_matches(key.replace("-", "_"), sorted(_BY_KEY), n=1, cutoff=0.7)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SettingsError(
                f"config file {path}: unknown key {key!r} (keys are `serve` flag names){hint}"
            )
        values[flag.dest] = _convert(flag, raw, f"config file {path} key {key!r}")
    return values


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """Flag values (by argparse dest) from ROLLOUT_GRPC_* variables."""
    values: dict[str, Any] = {}
    for flag in FLAGS:
        if flag.env in environ:
            values[flag.dest] = _convert(flag, environ[flag.env], f"environment {flag.env}")
    return values


@dataclass(frozen=True, slots=True)
class UnknownVariable:
    """A ROLLOUT_GRPC_* environment variable that no setting reads, and the one it probably meant."""

    name: str
    #: The closest setting's variable and flag, when one is close enough to be a likely typo.
    meant: str | None = None
    flag: str | None = None

    def __str__(self) -> str:
        hint = ""
        if self.meant:
            hint = f"; did you mean {self.meant}" + (f" ({self.flag})?" if self.flag else "?")
        return f"environment variable {self.name} matches no setting and is ignored{hint}"


def unknown_variables(environ: Mapping[str, str]) -> list[UnknownVariable]:
    """The ROLLOUT_GRPC_* variables of `environ` that nothing reads: a misspelt setting would
    otherwise be silently ignored and the default used in its place."""
    by_env = {flag.env: flag for flag in FLAGS}
    known = set(by_env) | set(OTHER_VARIABLES)
    by_alias = {
        ENV_PREFIX + a.removeprefix("--").replace("-", "_").upper(): flag
        for flag in FLAGS
        for a in flag.aliases
    }
    unknown: list[UnknownVariable] = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name.startswith(OTHER_PREFIXES):
            continue
        # Compared without the shared prefix, which would make every name look close.
        suffixes = sorted(k.removeprefix(ENV_PREFIX) for k in known)
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), suffixes, n=1, cutoff=0.75)
        meant = ENV_PREFIX + close[0] if close else None
        if name in by_alias:  # flag aliases (--sim-engines) have no variables of their own
            meant = by_alias[name].env
        flag = by_env[meant].name if meant in by_env else None
        unknown.append(UnknownVariable(name, meant, flag))
    return unknown
