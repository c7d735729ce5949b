"""A busy port is an error: every port of `serve` fails fast with one line naming it (issue 23.1).

The port is held the way another replica holds it: a listening socket with `SO_REUSEPORT` on (gRPC
core's default), which a second gRPC server would otherwise join and share silently.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import pytest

from tests.support.processes import child_env, replica_command

#: `serve` must give up on a busy port quickly (the simulated engines start first).
EXIT_BOUND_S = 60


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another process-like listener holds, with SO_REUSEPORT set."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


@pytest.mark.parametrize(
    ("flag", "what"),
    [
        ("--port", "gRPC, --port"),
        ("--health-port", "health, --health-port"),
        ("--metrics-port", "metrics, --metrics-port"),
        ("--openai-port", "the OpenAI front door, --openai-port"),
    ],
)
def test_a_busy_port_is_one_clear_error(held_port: int, flag: str, what: str) -> None:
    ports = {"--port": "0", "--health-port": "0", "--metrics-port": "0", "--openai-port": "0"}
    ports[flag] = str(held_port)
    args = [arg for pair in ports.items() for arg in pair]
    result = subprocess.run(
        [*replica_command(), "serve", "--sim", "1", "--host", "127.0.0.1", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=EXIT_BOUND_S,
        env={k: v for k, v in child_env().items() if not k.startswith("ROLLOUT_GRPC_")},
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("rollout-grpc serve:")]
    assert lines == [
        f"rollout-grpc serve: cannot listen on 127.0.0.1:{held_port} ({what}): address already in use: "
        "another process is listening there (`ss -ltnp` names it)"
    ], result.stderr
    assert '"serving"' not in result.stdout and "event='serving'" not in result.stdout
