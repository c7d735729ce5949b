"""The `rollout-grpc` console script: a one-line error, not a traceback, when the server cannot run here."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Check the server environment, then run `rollout_grpc.cli`."""
    try:
        import rollout_grpc.server  # noqa: F401  (runs the environment check)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    from rollout_grpc.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
