"""The port file announces a replica that handles its signals: SIGTERM and SIGINT drain it, SIGHUP
reloads it. An operator (or a test) signals a replica as soon as its port file exists; a signal
that arrives before `serve` installed its handlers takes the default action and kills it (exit -15
instead of a drain, or a SIGHUP that ends the replica instead of reloading it).

Found under load: `serve --workers 1` SIGTERMed at once after its port file exited -15 in 2 of 20
starts at load ~5 (`serve` wrote the file, then installed its handlers). Deterministic here: the
port file's temporary file is a FIFO, so `serve` blocks in opening it at the moment it announces
readiness, and the test reads which signals the process catches right then (/proc, `SigCgt`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.support.processes import Processes, replica_command, wait_until

#: The signals a serving replica must catch (not leave at their default action, which kills it).
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def caught(pid: int) -> set[signal.Signals]:
    """The signals `pid` has a handler for now (the `SigCgt` mask of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return {sig for sig in signal.Signals if mask >> (sig - 1) & 1}
    raise AssertionError(f"no SigCgt line for pid {pid}")


def opening_fifo(pid: int) -> bool:
    """`pid` is blocked opening a FIFO for writing (waiting for a reader)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text().strip() == "wait_for_partner"
    except FileNotFoundError:
        return False


def test_a_single_process_replica_handles_its_signals_once_it_writes_its_port_file(tmp_path: Path) -> None:
    port_file = tmp_path / "replica.json"
    os.mkfifo(f"{port_file}.tmp")  # `serve` writes the file's content there, then renames it
    with Processes(tmp_path) as procs:
        proc = procs.start(
            "replica",
            [
                *replica_command(),
                "serve",
                "--sim",
                "1",
                "--workers",
                "1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--log-format",
                "json",
            ],
        )
        wait_until("serve opening its port file", lambda: opening_fifo(proc.pid), proc)
        handled = caught(proc.pid)
        with open(f"{port_file}.tmp") as fifo:  # lets `serve` go on
            assert '"grpc"' in fifo.read()
        missing = sorted(sig.name for sig in HANDLED if sig not in handled)
        assert not missing, f"serve announced itself ready with {missing} at their default action"
