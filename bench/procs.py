"""Child processes of a benchmark run (simulated engines, service replicas, nginx) and their meters.

Why separate processes: the service's CPU time and peak RSS must be measured on their own (psutil
on one PID), and engines must not share an event loop with the code under test. Starting and
stopping them is the same job the deployment tests do, so it is done by the same supervisor,
`tests/support/processes.py`: every process writes a port file (`--port 0 --port-file F`, so no
fixed ports and no races), belongs to a `Processes` group, and is stopped by PID (SIGTERM, then
SIGKILL) when the group closes, which callers do in a `finally` block or `with` statement. What is
the benchmark's own lives here: the engine and replica flags of a run, and the `Meter`.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.support.processes import (
    REPO,
    Engine,
    Proc,
    Processes,
    Replica,
    StartupError,
    fresh_port_file,
    nginx_binary,
    read_port_file,
    replica_command,
    start_engine,
    start_nginx,
    start_replica,
)

__all__ = [
    "REPO",
    "Engine",
    "Meter",
    "Processes",
    "Replica",
    "SimPool",
    "StartupError",
    "fresh_port_file",
    "nginx_binary",
    "one_process_flags",
    "read_port_file",
    "start_nginx",
    "start_service",
    "start_sim",
    "start_sim_pool",
    "workers_flag",
]


def start_sim(
    group: Processes,
    name: str,
    token_delay_ms: float,
    seed: int,
    src: Path | None = None,
    extra: list[str] | None = None,
) -> Engine:
    """A simulated vLLM engine in its own process (`python -m rollout_grpc.sim`) that never stops
    early (EOS off) and takes long prompts. `extra` flags come last, so they override the defaults
    here (argparse keeps the last value)."""
    return start_engine(
        group,
        name,
        "--eos-probability",
        "0",
        "--max-model-len",
        "8192",
        *(extra or []),
        token_delay_ms=token_delay_ms,
        seed=seed,
        src=src,
    )


def start_service(
    group: Processes,
    name: str,
    engines: list[str],
    extra: list[str] | None = None,
    src: Path | None = None,
) -> Replica:
    """A service replica (`rollout-grpc serve`) in its own process, logging warnings only.

    One process (`one_process_flags`) when it runs this checkout's code: the meters read one PID.
    """
    single = list(one_process_flags()) if src is None else []
    return start_replica(group, name, engines, ["--log-level", "warning", *single, *(extra or [])], src=src)


@dataclass
class SimPool:
    """One process serving several simulated engines (`bench/sim_pool.py`)."""

    proc: Proc
    urls: list[str]


def start_sim_pool(
    group: Processes,
    name: str,
    engines: int,
    token_delay_ms: float,
    seed: int,
    extra: list[str] | None = None,
) -> SimPool:
    """`engines` simulated engines in one process, configured as `start_sim` configures one."""
    port_file = fresh_port_file(group.workdir / f"{name}.ports")
    argv = [
        sys.executable,
        "-m",
        "bench.sim_pool",
        "--engines",
        str(engines),
        "--port-file",
        str(port_file),
        "--token-delay-ms",
        str(token_delay_ms),
        "--seed",
        str(seed),
        "--eos-probability",
        "0",
        "--max-model-len",
        "8192",
        *(extra or []),
    ]
    proc = group.start(name, argv, cwd=REPO)
    ports = json.loads(read_port_file(port_file, proc))
    return SimPool(proc, [f"http://127.0.0.1:{port}" for port in ports])


def workers_flag(serve_help: str) -> list[str]:
    """`--workers 1` when `serve --help` lists a `--workers` flag, else nothing.

    Why: the benchmarks describe one service process (its CPU and RSS are read from one PID); a
    `serve` that can fork workers must be told to stay one process, and an older one has no flag.
    """
    for token in serve_help.replace("[", " ").replace("]", " ").replace(",", " ").split():
        if token == "--workers" or token.startswith("--workers="):
            return ["--workers", "1"]
    return []


@functools.cache
def one_process_flags() -> tuple[str, ...]:
    """The `serve` flags that keep a replica in one process, read from this checkout's `serve --help`."""
    result = subprocess.run(
        [*replica_command(), "serve", "--help"], check=False, capture_output=True, text=True, timeout=60
    )
    return tuple(workers_flag(result.stdout))


class Meter:
    """CPU seconds and peak RSS of a set of PIDs over one measured interval.

    CPU comes from `psutil.Process.cpu_times()` (user + system, before and after). Peak RSS is
    sampled by a background thread every `interval_s` (the kernel's VmHWM is a lifetime peak and
    would carry one row's peak into the next).
    """

    def __init__(self, pids: dict[str, int], interval_s: float = 0.02) -> None:
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._interval = interval_s
        self._cpu0: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}
        self.peak_rss: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _cpu(self, name: str) -> float:
        times = self._procs[name].cpu_times()
        return float(times.user + times.system)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for name, proc in self._procs.items():
                try:
                    rss = int(proc.memory_info().rss)
                except psutil.Error:
                    continue
                if rss > self.peak_rss.get(name, 0):
                    self.peak_rss[name] = rss
            self._stop.wait(self._interval)

    def __enter__(self) -> Meter:
        self._cpu0 = {name: self._cpu(name) for name in self._procs}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu_s = {name: self._cpu(name) - self._cpu0[name] for name in self._procs}
