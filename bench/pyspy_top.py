"""The hottest frames of py-spy's collapsed stacks (`py-spy record --format raw`), self and inclusive.

Why: comparing where one worker and two workers spend their CPU (bench/workers.py `--py-spy`) needs
the frames as numbers side by side, not two flame graphs.

    python -m bench.pyspy_top FILE [FILE ...] [--top 25] [--match admission]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def load(path: Path) -> list[tuple[list[str], int]]:
    """(frames root first, samples) per collapsed line."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pyspy_top", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--match", action="append", default=[], help="inclusive share of frames containing this"
    )
    args = parser.parse_args(argv)
    for path in args.files:
        stacks = load(path)
        total = sum(n for _, n in stacks) or 1
        own: collections.Counter[str] = collections.Counter()
        inclusive: collections.Counter[str] = collections.Counter()
        for frames, n in stacks:
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
        print(f"== {path.name}: {total} samples")
        for frame, n in own.most_common(args.top):
            print(f"  self {100 * n / total:5.1f}%  incl {100 * inclusive[frame] / total:5.1f}%  {frame}")
        for needle in args.match:
            n = sum(c for frames, c in stacks if any(needle in f for f in frames))
            print(f"  [{needle}] inclusive {100 * n / total:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
