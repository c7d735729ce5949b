"""The server's supported environment, checked before any server module loads.

Why: `pip install rollout-grpc` installs only the client (Python 3.10+, old and new protobuf and
grpcio). The replica is tested on Python 3.11 with the pins of the `server` extra; started anywhere
else it would fail later and obscurely (a missing aiohttp deep in an import, an older grpcio's
missing server option). This module is stdlib-only so it can run before those imports.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys

#: The interpreter the server is tested on.
SERVER_PYTHON = (3, 11)
#: Minimum versions of the `server` extra whose version matters at runtime.
SERVER_MINIMUMS = {"grpcio": (1, 85, 1), "protobuf": (7, 35, 1)}
#: Modules the server imports, with the distribution that provides each.
SERVER_MODULES = {
    "aiohttp": "aiohttp",
    "structlog": "structlog",
    "orjson": "orjson",
    "PIL": "pillow",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "grpc_status": "grpcio-status",
}
#: Set to 1 to start the server on an untested Python anyway (dependencies are still checked).
ALLOW_ENV = "ROLLOUT_GRPC_ALLOW_UNTESTED_PYTHON"
INSTALL_HINT = "install it with: python3.11 -m pip install 'rollout-grpc[server]'"


def _version_tuple(text: str) -> tuple[int, ...]:
    """(1, 85, 1) from "1.85.1" or "1.85.1rc1"; missing parts count as 0."""
    return tuple(int(m) for m in re.findall(r"\d+", text)[:3])


def problems() -> list[str]:
    """What keeps the server from running in this interpreter (empty when it can run)."""
    found: list[str] = []
    if sys.version_info[:2] != SERVER_PYTHON and os.environ.get(ALLOW_ENV) != "1":
        found.append(
            f"the server runs on Python {'.'.join(map(str, SERVER_PYTHON))}, this is "
            f"{sys.version_info.major}.{sys.version_info.minor} (the client alone supports 3.10+; "
            f"set {ALLOW_ENV}=1 to try anyway)"
        )
    for dist, minimum in SERVER_MINIMUMS.items():
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{dist} is not installed")
            continue
        if _version_tuple(installed) < minimum:
            found.append(f"{dist} {installed} is older than the server's {'.'.join(map(str, minimum))}")
    missing = [dist for module, dist in SERVER_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        found.append(f"missing server dependencies: {', '.join(missing)}")
    return found


def require_server_environment() -> None:
    """Raise RuntimeError naming every problem and the install command."""
    found = problems()
    if found:
        raise RuntimeError("rollout-grpc server: " + "; ".join(found) + f". {INSTALL_HINT}")
