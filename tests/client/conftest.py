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
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from rollout_grpc.client import pb
from tests.client.common import RefuseOnce, Silent
from tests.client.replica import METRICS_ENV, TARGET_ENV, Replica

ROOT = Path(__file__).resolve().parents[2]
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


def _wait_for_port_file(path: Path, proc: subprocess.Popen[bytes]) -> dict[str, object]:
    """The replica's ports once it wrote its port file (bounded; fails if the process died)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists():
            ports: dict[str, object] = json.loads(path.read_text())
            return ports
        if proc.poll() is not None:
            raise RuntimeError(f"tools/serve_sim.sh exited with {proc.returncode}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)  # wakes early if the server dies; otherwise re-check the file
    raise RuntimeError(f"the replica wrote no port file within {START_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def replica() -> Iterator[Replica]:
    """A live replica on simulated engines (the given one, or one started for this session)."""
    given = os.environ.get(TARGET_ENV)
    if given:
        yield Replica(given, os.environ.get(METRICS_ENV) or None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port.json"
        env = {**os.environ, "ROLLOUT_SERVER_PYTHON": os.environ.get("ROLLOUT_SERVER_PYTHON", sys.executable)}
        proc = subprocess.Popen(["bash", str(ROOT / "tools" / "serve_sim.sh"), str(port_file)], env=env)
        try:
            ports = _wait_for_port_file(port_file, proc)
            yield Replica(f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['metrics']}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def target(replica: Replica) -> str:
    """host:port of a live replica on simulated engines."""
    return replica.target


@pytest.fixture
async def refusing() -> AsyncIterator[tuple[str, RefuseOnce]]:
    fake = RefuseOnce()
    handler = grpc.method_handlers_generic_handler(
        "rollout.v1.RolloutService",
        {
            "GetServerInfo": grpc.unary_unary_rpc_method_handler(
                fake.info,
                request_deserializer=pb.GetServerInfoRequest.FromString,
                response_serializer=pb.GetServerInfoResponse.SerializeToString,
            ),
            "Generate": grpc.unary_stream_rpc_method_handler(
                fake.generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", fake
    finally:
        await server.stop(None)


@pytest.fixture
def silent() -> Iterator[str]:
    """host:port of a RolloutService that never answers Generate (a threaded server, so blocking
    and async tests alike can call it)."""
    fake = Silent()
    handler = grpc.method_handlers_generic_handler(
        "rollout.v1.RolloutService",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                fake.generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
        },
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        fake.release.set()
        server.stop(None)
