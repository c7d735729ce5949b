"""Argparse types for numbers in a range, shared by every command's flags.

`type=int` takes `-5` for a port and `float` takes `nan` for a timeout; the command then fails
later with a traceback, or runs and does nothing. A flag typed with `number(int, low=1)` is refused
while the command line is read, with argparse's one line naming the flag and what it allows.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

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
