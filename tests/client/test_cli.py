"""The `rollout-grpc` console script in the interpreter's own environment: in the client-only install
(tools/client_matrix.sh on Python 3.10-3.13, tests/deploy/test_wheel.py) it must still print its
help and version and run `info`, which need only the client's dependencies (grpcio, protobuf,
numpy); the server commands say what to install.

Before, every command, `--help` included, failed there with "missing server dependencies".
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rollout_grpc
from tests.client.replica import Replica

#: The console script next to this interpreter (the venv's bin directory).
SCRIPT = Path(sys.executable).with_name("rollout-grpc")
#: The server extra installed here (the dev virtualenv), or the client alone (the wheel tests).
SERVER_EXTRA = importlib.util.find_spec("aiohttp") is not None and sys.version_info[:2] == (3, 11)


def rollout_grpc_command(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`rollout-grpc ARGS` run from `cwd` (not the checkout, whose package must not be imported)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("ROLLOUT_GRPC_")}
    return subprocess.run(
        [str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_help_and_version_run_on_the_clients_dependencies(tmp_path: Path) -> None:
    assert SCRIPT.is_file(), f"no console script at {SCRIPT}"
    helped = rollout_grpc_command("--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: rollout-grpc")
    assert all(command in helped.stdout for command in ("serve", "sim", "info", "demo"))
    version = rollout_grpc_command("--version", cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"rollout-grpc {rollout_grpc.__version__}"
    info_help = rollout_grpc_command("info", "--help", cwd=tmp_path)
    assert info_help.returncode == 0 and "--target" in info_help.stdout, info_help.stderr


def test_info_runs_on_the_clients_dependencies(replica: Replica, tmp_path: Path) -> None:
    """`info` calls GetServerInfo and the standard health service without grpcio-health-checking."""
    result = rollout_grpc_command("info", "--target", replica.target, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["health"] == "SERVING"
    assert body["engines"] and body["version"]
    table = rollout_grpc_command("info", "--target", replica.target, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert f"replica {replica.target}" in table.stdout and "health SERVING" in table.stdout


@pytest.mark.parametrize("command", ["serve", "sim", "demo"])
def test_server_commands_say_what_to_install(command: str, tmp_path: Path) -> None:
    result = rollout_grpc_command(command, "--help", cwd=tmp_path)
    if SERVER_EXTRA:  # the dev virtualenv: the command is there
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: rollout-grpc {command}")
    else:
        assert result.returncode == 2, result.stdout
        assert f"rollout-grpc {command}: rollout-grpc server:" in result.stderr
        assert "pip install 'rollout-grpc[server]'" in result.stderr
        assert "Traceback" not in result.stderr
