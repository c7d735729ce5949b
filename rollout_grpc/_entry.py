"""The `rollout-grpc` console script.

It must start in the client-only install (`pip install rollout-grpc`, no `server` extra, Python
3.10-3.13): `--help`, `--version` and `info` need only the client's dependencies; the server
commands check the server environment first and say what to install (`rollout_grpc.cli`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run `rollout_grpc.cli`."""
    from rollout_grpc.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
