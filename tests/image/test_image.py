"""The container image starts and serves: `make test-image` (which builds it first, `make image`).

The image's own entrypoint runs `serve --sim 2` inside a buildah container (chroot isolation in the
host's network namespace: podman and runc need cgroup and rlimit rights this machine does not
grant), with a host directory mounted for the port file. From the host, with the checkout's
client: health SERVING, one Generate completes, /metrics answers; the server runs as the image's
unprivileged user from the image's virtualenv; SIGTERM to it (buildah does not forward signals)
stops it with exit code 0. Every wait has a deadline; the container is removed in a finaliser.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc import __version__
from rollout_grpc.client import RolloutClient, make_sample, pb
from tests.support.processes import REPO

pytestmark = pytest.mark.image

IMAGE = os.environ.get("ROLLOUT_GRPC_IMAGE", f"localhost/rollout-grpc:{__version__}")
WAIT_S = 60.0
PORT_FILE = "/run/rollout-grpc/ports.json"
# `buildah run` without a runtime (chroot) in the host's network: the server's ports are the host's.
RUN_OPTIONS = ("--isolation", "chroot", "--network", "host")
UID = 10001  # deploy/k8s/deployment.yaml runs the pod as 10001:10001
USER = f"{UID}:{UID}"


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    log: Path
    ports: dict[str, Any]
    server: psutil.Process


def buildah() -> str:
    path = shutil.which("buildah")
    if path is None:
        pytest.skip("buildah is not installed (apt-get install buildah mmdebstrap; .ci/run does)")
    return path


def image_config() -> dict[str, Any]:
    proc = subprocess.run(
        [buildah(), "inspect", "--type", "image", IMAGE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"no image {IMAGE} ({proc.stderr.strip()}): `make image` builds it")
    config: dict[str, Any] = json.loads(proc.stdout)["OCIv1"]["config"]
    return config


def wait_for_ports(path: Path, proc: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    """The port file's content once the server wrote it (it does so when serving)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            ports: dict[str, Any] = json.loads(path.read_text())
            return ports
        if proc.poll() is not None:
            pytest.fail(f"the container exited with {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)  # wakes early if the container dies; otherwise re-check the file
    pytest.fail(f"no port file within {WAIT_S} s:\n{log.read_text()}")


def server_process(proc: subprocess.Popen[bytes]) -> psutil.Process:
    """The Python process of `rollout-grpc serve` under `buildah run` (same PID namespace)."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            cmdline = child.cmdline()
            if len(cmdline) > 1 and Path(cmdline[0]).name.startswith("python") and "serve" in cmdline:
                return child
    pytest.fail(f"no rollout-grpc serve process under buildah run (pid {proc.pid})")


def wait_serving(target: str) -> None:
    """Poll grpc.health.v1 until the rollout service is SERVING (bounded)."""
    deadline = time.monotonic() + WAIT_S
    status = None
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                request = health_pb2.HealthCheckRequest(service="rollout.v1.RolloutService")
                status = stub.Check(request, timeout=5, wait_for_ready=True).status
            except grpc.RpcError as exc:
                status = exc.code()
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.2)  # poll interval, not synchronisation: the deadline bounds the loop
    pytest.fail(f"health not SERVING within {WAIT_S} s: {status}")


def stop(running_proc: subprocess.Popen[bytes], server: psutil.Process | None) -> None:
    """SIGTERM the server and wait for the container; past the deadline, or without a server
    process, SIGKILL what is left (buildah itself SIGKILLs its command on SIGTERM)."""
    if running_proc.poll() is not None:
        return
    if server is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            running_proc.wait(timeout=WAIT_S)
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            server.kill()
    running_proc.terminate()
    try:
        running_proc.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        running_proc.kill()
        running_proc.wait(timeout=WAIT_S)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    """`rollout-grpc serve --sim 2` in a container of the image, ports chosen by the server."""
    config = image_config()
    tool = buildah()
    name = f"rollout-grpc-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        [tool, "from", "--quiet", "--name", name, IMAGE], check=True, capture_output=True, timeout=120
    )
    proc: subprocess.Popen[bytes] | None = None
    server: psutil.Process | None = None
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        run_dir.chmod(0o777)  # the server runs as the image's user, not root
        log = tmp_path / "serve.log"
        command = [
            *config["Entrypoint"],
            *("serve", "--sim", "2", "--host", "127.0.0.1", "--port", "0", "--health-port", "0"),
            *("--metrics-port", "0", "--port-file", PORT_FILE, "--log-level", "info"),
        ]
        mount = f"{run_dir}:{Path(PORT_FILE).parent}"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [tool, "run", *RUN_OPTIONS, "--volume", mount, name, "--", *command],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        ports = wait_for_ports(run_dir / Path(PORT_FILE).name, proc, log)
        server = server_process(proc)
        yield Running(proc, log, ports, server)
    finally:
        if proc is not None:
            stop(proc, server)
        subprocess.run([tool, "rm", name], capture_output=True, timeout=120, check=False)


def image_megabytes(reference: str) -> float:
    """The image's size as `buildah images` reports it ("353 MB")."""
    proc = subprocess.run(
        [buildah(), "images", "--format", "{{.Size}}", reference],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    number, unit = proc.stdout.split()
    return float(number) * {"kB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]


def test_the_build_leaves_no_unnamed_image_and_the_size_is_the_documented_one() -> None:
    """Before, each build left its build stage as an unnamed 471 MB image (`--layers`), a rebuild
    left the image it replaced, and the image was 427 MB where deploy/README.md said about 340."""
    image_config()  # skips without the image
    dangling = subprocess.run(
        [buildah(), "images", "--filter", "dangling=true", "--format", "{{.ID}} {{.Size}}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split("\n")
    assert not [line for line in dangling if line.strip()], f"unnamed images left by the build: {dangling}"
    documented = re.search(r"The image is (\d+) MB", (REPO / "deploy" / "README.md").read_text())
    assert documented, "deploy/README.md states no measured image size"
    # The same dependency versions give the same size; a few MB of slack for a patch release.
    assert image_megabytes(IMAGE) <= int(documented.group(1)) * 1.03


def test_the_image_is_configured_for_the_deployment() -> None:
    config = image_config()
    assert config["Entrypoint"] == ["rollout-grpc"]
    assert config["Cmd"] == ["serve"]
    assert config["User"] == USER
    assert set(config["ExposedPorts"]) == {"50051/tcp", "50052/tcp", "9464/tcp", "8100/tcp"}


def test_the_image_serves_from_the_host_and_stops_cleanly(running: Running) -> None:
    assert running.server.uids().real == UID
    assert running.server.cmdline()[1] == "/opt/rollout-grpc/bin/rollout-grpc"

    wait_serving(f"127.0.0.1:{running.ports['health']}")
    with RolloutClient(f"127.0.0.1:{running.ports['grpc']}", timeout=30) as client:
        sample = client.generate(make_sample([1, 92, 510, 206]), {"max_new_tokens": 8})
    assert sample.status in (pb.SAMPLE_STATUS_COMPLETED, pb.SAMPLE_STATUS_TRUNCATED), sample
    assert 0 < sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs) <= 8
    with urllib.request.urlopen(f"http://127.0.0.1:{running.ports['metrics']}/metrics", timeout=10) as r:
        assert b"rollout" in r.read()

    running.server.send_signal(signal.SIGTERM)
    assert running.proc.wait(timeout=WAIT_S) == 0, running.log.read_text()
    assert '"event":"stopped"' in running.log.read_text()
