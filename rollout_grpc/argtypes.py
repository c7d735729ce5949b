"""Argparse types for numbers in a range, and the parser every command uses.

`type=int` takes `-5` for a port and `float` takes `nan` for a timeout; the command then fails
later with a traceback, or runs and does nothing. A flag typed with `number(int, low=1)` is refused
while the command line is read, with argparse's one line naming the flag and what it allows.

`CommandParser` is argparse without prefix matching (`serve --engines URL` was read as
`--engines-file URL`) and with errors as one line (argparse printed the whole usage first, 70 lines
for `serve`, above the line that says what is wrong).
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

N = TypeVar("N", int, float)

#: The largest TCP port.
MAX_PORT = 65535


def number(
    parse: Callable[[str], N], *, low: float = 0, above: bool = False, high: float | None = None
) -> Callable[[str], N]:
    """`parse` (int or float) refusing NaN, infinities, values under `low` (or equal to it when
    `above`) and over `high`, with an `argparse.ArgumentTypeError` saying what is allowed."""

    def convert(text: str) -> N:
        value = parse(text)  # a ValueError: argparse's "invalid int value: 'abc'"
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text.strip()!r}")
        got = f"got {value:g}" if isinstance(value, float) else f"got {value}"
        if above and value <= low:
            raise argparse.ArgumentTypeError(f"must be greater than {low:g}, {got}")
        if value < low:
            wanted = "must not be negative" if low == 0 else f"must be at least {low:g}"
            raise argparse.ArgumentTypeError(f"{wanted}, {got}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, {got}")
        return value

    convert.__name__ = parse.__name__  # argparse names the type in "invalid int value"
    return convert


#: A TCP port to bind: 0 (any free port) to 65535.
port = number(int, high=MAX_PORT)


class CommandParser(argparse.ArgumentParser):
    """An `ArgumentParser` that never abbreviates and fails in one line naming the flag.

    `allow_abbrev=False` is forced, not defaulted: subparsers are built by `add_parser`, which
    passes only what it is given, and `parents=` copies actions, not this setting. Subparsers of a
    CommandParser are CommandParsers (argparse makes them of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Exit 2 (argparse's code for bad usage) with one line on stderr, no usage block."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """Fail naming the arguments no flag took (`unrecognized_message`)."""
        self.error(unrecognized_message(self, extras))

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """`parse_known_args`, then `unrecognized` for what is left over, named by the subparser
        that was parsing (the top-level parser knows none of a subcommand's flags)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._leaf(parsed).unrecognized(extras)
        return parsed

    def _leaf(self, parsed: argparse.Namespace) -> CommandParser:
        """The deepest parser of the subcommands named in `parsed`."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and action.dest:
                child = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(child, CommandParser):
                    return child._leaf(parsed)
        return self


def unrecognized_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The error for arguments no flag of `parser` took, with the closest flag when the first unknown
    one looks misspelt or shortened (`--engines` for `--engine`, `--tim` for `--timeout`)."""
    message = f"unrecognized arguments: {' '.join(extras)}"
    flags = sorted(s for s in parser._option_string_actions if s.startswith("--"))
    unknown = next((e.split("=", 1)[0] for e in extras if e.startswith("--")), None)
    if unknown is not None:
        meant = difflib.get_close_matches(unknown, flags, n=1, cutoff=0.6)
        meant = meant or [f for f in flags if f.startswith(unknown)][:1]
        if meant:
            message += f"; did you mean {meant[0]}?"
    return message
