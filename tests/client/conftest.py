"""Client tests: they import only `rollout_grpc.client` / `rollout_grpc.integrations`, never the server.

They run in two places: in the dev virtualenv (`make test`), and by `tools/client_matrix.sh` in
client-only virtualenvs on Python 3.10-3.13 at the oldest and newest supported protobuf/grpcio.
The replica they talk to is `ROLLOUT_GRPC_TARGET` when set (the matrix starts one for all
interpreters), otherwise one started here with tools/serve_sim.sh (the one place that knows how).
With `ROLLOUT_CLIENT_SITE` set to a site-packages directory (tests/deploy/test_wheel.py, the matrix),
the session fails unless `rollout_grpc` was imported from there: the installed wheel, not the checkout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET_ENV = "ROLLOUT_GRPC_TARGET"
SITE_ENV = "ROLLOUT_CLIENT_SITE"
START_TIMEOUT_S = 60.0


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under `ROLLOUT_CLIENT_SITE`: stop before any test if the package under test is the checkout."""
    site = os.environ.get(SITE_ENV)
    if not site:
        return
    import rollout_grpc

    imported = Path(rollout_grpc.__file__).resolve()
    if not imported.is_relative_to(Path(site).resolve()):
        raise pytest.UsageError(f"rollout_grpc was imported from {imported}, not from {site} ({SITE_ENV})")


def _wait_for_port_file(path: Path, proc: subprocess.Popen[bytes]) -> int:
    """The gRPC port once the replica wrote its port file (bounded; fails if the process died)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists():
            return int(json.loads(path.read_text())["grpc"])
        if proc.poll() is not None:
            raise RuntimeError(f"tools/serve_sim.sh exited with {proc.returncode}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)  # wakes early if the server dies; otherwise re-check the file
    raise RuntimeError(f"the replica wrote no port file within {START_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def target() -> Iterator[str]:
    """host:port of a live replica on simulated engines."""
    given = os.environ.get(TARGET_ENV)
    if given:
        yield given
        return
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port.json"
        env = {**os.environ, "ROLLOUT_SERVER_PYTHON": os.environ.get("ROLLOUT_SERVER_PYTHON", sys.executable)}
        proc = subprocess.Popen(["bash", str(ROOT / "tools" / "serve_sim.sh"), str(port_file)], env=env)
        try:
            yield f"127.0.0.1:{_wait_for_port_file(port_file, proc)}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
