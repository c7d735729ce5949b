"""Signals and `serve --workers 2` around a worker's start: never a killed worker, never a stale list.

A worker installs its SIGHUP handler before it tells its supervisor it is ready; a SIGHUP that
reaches the supervisor earlier is held for that worker and sent once it is ready (SIGHUP's default
action kills a process: on a loaded machine a reload sent right after the port file appeared
killed both workers). A worker that starts after the engines file changed (a replacement) reads
the file itself instead of serving the list the supervisor read at its own start. A SIGTERM sent
to a worker itself before its link to the supervisor is open is passed on once it is.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_grpc.client import AsyncRolloutClient
from tests.support.processes import (
    Proc,
    Processes,
    fresh_port_file,
    replica_command,
    start_engine,
    wait_until,
)
from tests.support.workers import start_replica

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


def events(proc: Proc, event: str) -> list[dict[str, object]]:
    """`proc`'s JSON log records named `event`."""
    found = []
    for line in proc.log_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


async def test_a_sighup_before_the_workers_are_ready_waits_for_them(procs: Processes, tmp_path: Path) -> None:
    engine = start_engine(procs, "engine", token_delay_ms=0)
    # Stopped, the engine holds each worker's start in its capability probe: not ready yet.
    engine.proc.popen.send_signal(signal.SIGSTOP)
    port_file = fresh_port_file(tmp_path / "replica.ports.json")
    argv = [*replica_command(), "serve", "--port", "0", "--port-file", str(port_file), "--log-format", "json"]
    replica = procs.start("replica", [*argv, "--workers", "2", "--engine", engine.url])
    await asyncio.to_thread(
        wait_until, "both workers probing", lambda: len(events(replica, "engine_added")) == 2, replica
    )
    replica.popen.send_signal(signal.SIGHUP)
    await asyncio.to_thread(
        wait_until, "the SIGHUP", lambda: bool(events(replica, "sighup_forwarded")), replica
    )
    assert events(replica, "sighup_forwarded")[0]["held_until_ready"] == [0, 1]
    engine.proc.popen.send_signal(signal.SIGCONT)
    # Each worker handles the held SIGHUP once ready (no engines file: a line, and it serves on).
    await asyncio.to_thread(
        wait_until,
        "each worker's SIGHUP line",
        lambda: {r.get("worker") for r in events(replica, "sighup_engines_unchanged")} == {0, 1},
        replica,
    )
    assert events(replica, "worker_exited") == []
    grpc_port = json.loads(port_file.read_text())["grpc"]
    async with AsyncRolloutClient(f"127.0.0.1:{grpc_port}") as client:
        assert len((await client.server_info()).engines) == 1


def _serving_engines(replica: Proc, pid: int) -> list[object]:
    """The engines of the `worker_serving` line of the worker with `pid` ([] before it serves)."""
    restarted = [r for r in events(replica, "worker_restarted") if r.get("pid") == pid]
    if not restarted:
        return []
    index = restarted[0]["worker"]
    lines = [r for r in events(replica, "worker_serving") if r.get("worker") == index]
    engines = lines[-1]["engines"]
    assert isinstance(engines, list)
    return engines


async def test_a_replacement_worker_serves_the_engines_file_as_it_is_now(
    procs: Processes, tmp_path: Path
) -> None:
    first, second = (start_engine(procs, f"engine-{i}", token_delay_ms=0, seed=i) for i in range(2))
    path = tmp_path / "engines.txt"
    path.write_text(first.url + "\n")
    replica = start_replica(procs, tmp_path, "--workers", "2", "--engines-file", str(path))
    path.write_text(second.url + "\n")  # changed, no SIGHUP yet
    os.kill(replica.ports["worker_pids"][1], signal.SIGKILL)
    await asyncio.to_thread(
        wait_until,
        "the replacement worker",
        lambda: bool(events(replica.proc, "worker_restarted")),
        replica.proc,
    )
    pid = events(replica.proc, "worker_restarted")[0]["pid"]
    assert isinstance(pid, int)
    await asyncio.to_thread(
        wait_until, "its serving line", lambda: bool(_serving_engines(replica.proc, pid)), replica.proc
    )
    assert _serving_engines(replica.proc, pid) == [second.url]


async def test_a_replacement_worker_keeps_the_replicas_engines_when_the_file_went_bad(
    procs: Processes, tmp_path: Path
) -> None:
    engine = start_engine(procs, "engine", token_delay_ms=0)
    path = tmp_path / "engines.txt"
    path.write_text(engine.url + "\n")
    replica = start_replica(procs, tmp_path, "--workers", "2", "--engines-file", str(path))
    path.write_text("not a url\n")
    os.kill(replica.ports["worker_pids"][1], signal.SIGKILL)
    await asyncio.to_thread(
        wait_until,
        "the replacement worker",
        lambda: bool(events(replica.proc, "worker_restarted")),
        replica.proc,
    )
    pid = events(replica.proc, "worker_restarted")[0]["pid"]
    assert isinstance(pid, int)
    await asyncio.to_thread(
        wait_until, "its serving line", lambda: bool(_serving_engines(replica.proc, pid)), replica.proc
    )
    assert _serving_engines(replica.proc, pid) == [engine.url]
    invalid = events(replica.proc, "engines_file_invalid")
    assert invalid and "line 1" in str(invalid[0]["error"])
    assert replica.proc.popen.poll() is None


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (the supervisor's workers)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


async def test_a_sigterm_to_a_starting_worker_drains_the_replica(procs: Processes, tmp_path: Path) -> None:
    engine = start_engine(procs, "engine", token_delay_ms=0)
    engine.proc.popen.send_signal(signal.SIGSTOP)  # holds each worker's start in its probe
    port_file = fresh_port_file(tmp_path / "replica.ports.json")
    argv = [*replica_command(), "serve", "--port", "0", "--port-file", str(port_file), "--log-format", "json"]
    replica = procs.start("replica", [*argv, "--workers", "2", "--engine", engine.url])
    await asyncio.to_thread(
        wait_until, "both workers probing", lambda: len(events(replica, "engine_added")) == 2, replica
    )
    os.kill(_children(replica.popen.pid)[0], signal.SIGTERM)
    engine.proc.popen.send_signal(signal.SIGCONT)
    # Passed to the supervisor once the worker's link is open: the whole replica drains, exit 0
    # (at its default action the worker died and was replaced; the replica served on).
    code = await asyncio.to_thread(replica.popen.wait, 60)
    assert code == 0
    assert [r["signal"] for r in events(replica, "signal_passed_to_supervisor")] == ["SIGTERM"]
    assert events(replica, "worker_exited") == []
