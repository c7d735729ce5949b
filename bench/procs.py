"""Child processes of a benchmark run (simulated engines, service replicas, nginx) and their meters.

Why separate processes: the service's CPU time and peak RSS must be measured on their own (psutil
on one PID), and engines must not share an event loop with the code under test. Every process is
started with a port file (`--port 0 --port-file F`, so no fixed ports and no races), is owned by a
`ProcessGroup`, and is stopped by PID (SIGTERM, then SIGKILL) when the group closes, which callers
do in a `finally` block or `with` statement.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
STARTUP_TIMEOUT_S = 30.0


class StartupError(RuntimeError):
    """A child process exited or did not write its port file in time."""


@dataclass
class Child:
    """One started process: its Popen, where it logs, and what it reported in its port file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    info: Any = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    """Starts children and guarantees they are stopped (by PID) when the group is closed."""

    workdir: Path
    children: list[Child] = field(default_factory=list)

    def __enter__(self) -> ProcessGroup:
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        port_file: Path | None = None,
        parse: str = "json",
        ready_port: int | None = None,
        cwd: Path | None = None,
        src: Path | None = None,
    ) -> Child:
        """Start `argv`; wait for `port_file` (parsed as JSON or an int) or for `ready_port` to accept.

        `src` puts another copy of the `rollout_grpc` package first on the child's `PYTHONPATH`
        (ahead of the editable install) and runs the child in that directory (`python -m` puts
        the working directory first on `sys.path`), which is how `bench.compare` runs scratch
        variants.
        """
        log_path = self.workdir / f"{name}.log"
        if port_file is not None:
            port_file.unlink(missing_ok=True)  # a stale file from an earlier run would be read as ready
        log = log_path.open("wb")
        try:
            env = dict(os.environ)
            if src is not None:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH", "")]))
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd or src or REPO,
                env=env,
            )
        finally:
            log.close()
        child = Child(name, popen, log_path)
        self.children.append(child)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if popen.poll() is not None:
                raise StartupError(f"{name} exited with {popen.returncode}:\n{child.log_tail()}")
            if port_file is not None and port_file.exists():
                text = port_file.read_text()
                child.info = json.loads(text) if parse == "json" else int(text.strip())
                return child
            if ready_port is not None and _accepts(ready_port):
                child.info = ready_port
                return child
            if time.monotonic() > deadline:
                raise StartupError(
                    f"{name} did not become ready in {STARTUP_TIMEOUT_S}s:\n{child.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self, child: Child, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop one child by PID: `sig`, wait, then SIGKILL."""
        if child.popen.poll() is None:
            try:
                os.kill(child.pid, sig)
                child.popen.wait(timeout=timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.kill(child.pid, signal.SIGKILL)
                child.popen.wait(timeout=5)
        if child in self.children:
            self.children.remove(child)

    def close(self) -> None:
        """Stop every child still running, newest first."""
        for child in reversed(list(self.children)):
            try:
                self.stop(child)
            except Exception as exc:  # keep stopping the others
                print(f"warning: could not stop {child.name} (pid {child.pid}): {exc}", file=sys.stderr)


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def start_sim(
    group: ProcessGroup,
    name: str,
    token_delay_ms: float,
    seed: int,
    src: Path | None = None,
    extra: list[str] | None = None,
) -> str:
    """A simulated vLLM engine in its own process (`python -m rollout_grpc.sim`); returns its URL.

    `extra` flags come last, so they override the defaults here (argparse keeps the last value).
    """
    port_file = group.workdir / f"{name}.port"
    child = group.start(
        name,
        [
            sys.executable,
            "-m",
            "rollout_grpc.sim",
            "--port",
            "0",
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
        ],
        port_file=port_file,
        parse="int",
        src=src,
    )
    return f"http://127.0.0.1:{child.info}"


def start_service(
    group: ProcessGroup,
    name: str,
    engines: list[str],
    extra: list[str] | None = None,
    src: Path | None = None,
) -> tuple[Child, str]:
    """A service replica (`rollout-grpc serve`) in its own process; returns (child, grpc target)."""
    port_file = group.workdir / f"{name}.json"
    argv = [str(VENV_BIN / "rollout-grpc"), "serve"]
    for url in engines:
        argv += ["--engine", url]
    argv += [
        "--port",
        "0",
        "--health-port",
        "0",
        "--port-file",
        str(port_file),
        "--log-level",
        "warning",
        *(extra or []),
    ]
    child = group.start(name, argv, port_file=port_file, src=src)
    return child, f"127.0.0.1:{child.info['grpc']}"


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
