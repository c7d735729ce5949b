"""Log lines: readable on a terminal, JSON for everything else, or as `--log-format` says.

Before, `serve` wrote JSON lines on a terminal too unless told `--log-format console`. Each case runs
`rollout-grpc serve --sim 1` in a child whose standard error is a real pseudo-terminal or a pipe, and
reads its first log line (the SIMULATED ENGINES warning).
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest

from rollout_grpc import settings
from tests.support.processes import child_env, replica_command

#: An upper bound on the replica's start, not a pace: the line is read as soon as it is written.
START_BOUND_S = 60.0


def _first_line(read_fd: int, proc: subprocess.Popen[bytes]) -> str:
    """The child's first line on `read_fd` (bounded; fails if it exits first)."""
    data = b""
    deadline = time.monotonic() + START_BOUND_S
    while b"\n" not in data:
        assert time.monotonic() < deadline, f"no log line within {START_BOUND_S} s: {data!r}"
        ready, _, _ = select.select([read_fd], [], [], 1.0)
        if ready:
            chunk = os.read(read_fd, 4096)
            assert chunk, f"the replica closed standard error: {data!r}"
            data += chunk
        elif proc.poll() is not None:
            raise AssertionError(f"the replica exited with {proc.returncode}: {data!r}")
    return data.split(b"\n", 1)[0].decode().rstrip("\r")


def _serve_first_line(tmp_path: Path, *, tty: bool, extra: list[str]) -> str:
    read_fd, write_fd = pty.openpty() if tty else os.pipe()
    env = {k: v for k, v in child_env().items() if not k.startswith("ROLLOUT_GRPC_")} | {"NO_COLOR": "1"}
    argv = [*replica_command(), "serve", "--sim", "1", "--port", "0", "--health-port", "0", *extra]
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=write_fd, env=env
    )
    os.close(write_fd)
    try:
        return _first_line(read_fd, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        os.close(read_fd)


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


@pytest.mark.parametrize(
    ("tty", "extra", "want_json"),
    [
        (True, [], False),  # the default on a terminal: readable (was JSON)
        (False, [], True),  # the default into a pipe, a file, a log collector: JSON
        (True, ["--log-format", "json"], True),  # forced
        (False, ["--log-format", "console"], False),  # forced
    ],
)
def test_log_lines_are_readable_on_a_terminal_and_json_elsewhere(
    tmp_path: Path, tty: bool, extra: list[str], want_json: bool
) -> None:
    line = _serve_first_line(tmp_path, tty=tty, extra=extra)
    assert "simulated_engines" in line
    assert _is_json(line) is want_json, line
    if not want_json:
        assert "[warning  ]" in line and "\x1b[" not in line  # console renderer, no colours (NO_COLOR)


def test_log_format_auto_is_the_default() -> None:
    flag = next(f for f in settings.FLAGS if f.name == "--log-format")
    assert settings.flag_default(flag) == "auto"
    assert flag.choices == ("auto", "json", "console")
