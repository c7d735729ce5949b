"""The one process supervisor: simulated engines, replicas and nginx as subprocesses.

Used by the deployment and fault tests (`tests/deploy`, `tests/faults`, `tests/ops`) and by the
benchmarks (`bench/procs.py`): they run what an operator runs — `python -m rollout_grpc.sim`, the
`rollout-grpc serve` console script and nginx with `deploy/nginx/rollout-grpc.conf.template` —
each in its own process, talking over loopback TCP. Everything started here is registered with a
`Processes` group that stops each process by its PID (SIGTERM, then SIGKILL after a bounded wait),
so nothing outlives a test or a benchmark, also when it fails.

Readiness is never guessed with a sleep: a process is ready when it has written its port file
(engines, replicas) or accepts a TCP connection (nginx). Those waits poll with a deadline and fail
at once, with the process's log, when the process exits first (`StartupError`).

It lives in `tests/support` because both users run from a checkout (the wheel ships only
`rollout_grpc`), and `tests` is already an importable package there; `bench` imports it rather than
keeping a second copy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NGINX_TEMPLATE = REPO / "deploy" / "nginx" / "rollout-grpc.conf.template"
LOOPBACK = "127.0.0.1"

#: Deadline for a process to become ready (port file written / port accepting). A safety net, not
#: a measurement: a `serve` replica (a supervisor and two workers on a 2-core machine) took 7-16 s
#: to write its port file at load 7, and the nginx fixtures start five processes in a row; the
#: wait fails at once when the process exits, so a generous bound costs nothing when it works.
START_TIMEOUT_S = 60.0
#: How long a process gets to exit after SIGTERM in a finaliser before it is killed.
STOP_TIMEOUT_S = 15.0
#: Poll interval of the readiness waits (a file or a port is checked, not a guessed delay).
POLL_S = 0.02


def nginx_binary() -> str | None:
    """The nginx executable, also when /usr/sbin is not on PATH (unprivileged shells)."""
    found = shutil.which("nginx")
    if found:
        return found
    for candidate in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def replica_command() -> list[str]:
    """The installed `rollout-grpc` console script next to this interpreter (the venv's)."""
    script = Path(sys.executable).parent / "rollout-grpc"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "rollout_grpc.cli"]


def child_env(src: Path | None = None) -> dict[str, str]:
    """Environment of every child: unbuffered output, so a log line exists once it is emitted.

    `src` puts another copy of the `rollout_grpc` package first on `PYTHONPATH` (ahead of the
    editable install): how `bench.compare` runs scratch variants of the code.
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH", "")]))
    return env


class StartupError(RuntimeError):
    """A child process exited before it was ready."""


class StartupTimeout(StartupError, TimeoutError):
    """A child process did not become ready before its deadline."""


@dataclass
class Proc:
    """A started process and the file that receives its stdout and stderr."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self) -> str:
        """Everything the process has written so far."""
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def describe_exit(self) -> str:
        """Why a process is not usable: exit code plus the tail of its log."""
        return f"{self.name} (pid {self.pid}) exited with {self.popen.returncode}:\n{self.log_text()[-4000:]}"


@dataclass
class Processes:
    """A group of child processes stopped by PID, in reverse start order, by `stop_all()`.

    Also a context manager (`with Processes(workdir) as procs:`) that stops them on exit. After
    `stop_all()` the group is empty and may start new processes.
    """

    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def __enter__(self) -> Processes:
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    def start(
        self, name: str, argv: Sequence[str], *, src: Path | None = None, cwd: Path | None = None
    ) -> Proc:
        """Start `argv` in `cwd` with output to `<workdir>/<name>.log` (a file: a pipe nobody reads
        would fill up and block the child). With `src` (see `child_env`) the child runs in `src`,
        since `python -m` puts the working directory first on `sys.path`."""
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(src),
                cwd=src or cwd,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, sig: int = signal.SIGTERM) -> int:
        """Stop one process by its PID: `sig`, then SIGKILL if it has not exited in time.

        SIGCONT follows `sig`, so a process a test has SIGSTOPped handles it at once.
        """
        if proc.popen.poll() is None:
            proc.popen.send_signal(sig)
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGCONT)
            try:
                proc.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(STOP_TIMEOUT_S)
        return proc.popen.returncode

    def stop_all(self) -> None:
        """Stop every process of the group (the finaliser of every fixture that starts one).

        A process that cannot be stopped does not keep the others running: all are tried, then
        the first failure is raised.
        """
        procs, self.procs = self.procs, []
        failures: list[BaseException] = []
        for proc in reversed(procs):
            try:
                self.stop(proc)
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]


def wait_until(what: str, ready: Callable[[], bool], proc: Proc, timeout: float = START_TIMEOUT_S) -> None:
    """Poll `ready()` until it is true; fail early if `proc` exits, fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.popen.poll() is not None:
            raise StartupError(f"waiting for {what}: {proc.describe_exit()}")
        if time.monotonic() > deadline:
            raise StartupTimeout(
                f"{what} not ready after {timeout}s; log of {proc.name}:\n{proc.log_text()[-4000:]}"
            )
        time.sleep(POLL_S)


def read_port_file(path: Path, proc: Proc) -> str:
    """The content of a port file once it exists (both writers create it atomically by rename)."""
    wait_until(f"port file {path.name}", path.exists, proc)
    return path.read_text()


def fresh_port_file(path: Path) -> Path:
    """`path`, with a stale file from an earlier run removed (it would be read as ready)."""
    path.unlink(missing_ok=True)
    return path


def tcp_accepts(port: int, host: str = LOOPBACK) -> bool:
    """True when something listens on host:port."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (outgoing connections take their local ports from it)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_listen_port(rng: random.Random, attempts: int = 50) -> int:
    """A free loopback port below the ephemeral range.

    nginx opens upstream connections from ephemeral ports; after a load test thousands of
    TIME_WAIT sockets hold random ports there, and a listen port taken from that range can fail
    to bind later. The port is checked by binding it; the caller still retries on a bind failure,
    since another process may take it in between.
    """
    low = min(20000, ephemeral_range()[0] - 1000)
    high = ephemeral_range()[0] - 1
    for _ in range(attempts):
        port = rng.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{high} after {attempts} attempts")


# ------------------------------------------------------------------------------------ components


@dataclass
class Engine:
    """A simulated vLLM engine process."""

    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def start_engine(
    procs: Processes,
    name: str,
    *extra: str,
    token_delay_ms: float,
    seed: int = 0,
    src: Path | None = None,
    test_routes: bool = False,
) -> Engine:
    """`python -m rollout_grpc.sim --port 0 --port-file F ... EXTRA`; ready once F exists.

    `extra` are more `rollout-grpc sim` flags (e.g. `--eos-probability 0`); `src` as in `child_env`.
    `test_routes` runs `tests.support.sim_server` instead (the same engine plus the `/_sim/*`
    routes), from the repository root.
    """
    port_file = fresh_port_file(procs.workdir / f"{name}.port")
    argv = [
        sys.executable,
        "-m",
        "tests.support.sim_server" if test_routes else "rollout_grpc.sim",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--token-delay-ms",
        str(token_delay_ms),
        "--seed",
        str(seed),
        *extra,
    ]
    proc = procs.start(name, argv, src=src, cwd=REPO if test_routes else None)
    return Engine(proc, int(read_port_file(port_file, proc)))


@dataclass
class Replica:
    """A `rollout-grpc serve` process."""

    proc: Proc
    port: int
    health_port: int
    engines: list[str]
    #: Everything the replica wrote to its port file (e.g. `openai` with `--openai-port`).
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def health_target(self) -> str:
        return f"{LOOPBACK}:{self.health_port}"

    def log_events(self, event: str) -> list[dict[str, object]]:
        """The replica's JSON log records named `event`.

        Output is unbuffered; a record is read as soon as the replica has written it.
        """
        records = []
        for line in self.proc.log_text().splitlines():
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event:
                records.append(record)
        return records


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free a moment ago, for processes that must know each other's
    port before they start (replicas that name each other as `--peer`)."""
    ports: set[int] = set()
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            ports.add(int(sock.getsockname()[1]))
    return sorted(ports)


def start_replica(
    procs: Processes,
    name: str,
    engines: Sequence[Engine | str],
    extra: Sequence[str] = (),
    src: Path | None = None,
) -> Replica:
    """`rollout-grpc serve --engine URL... --port 0 --health-port 0 --port-file F --log-format json`.

    `engines` are engine processes or URLs; `src` as in `child_env`.
    """
    port_file = fresh_port_file(procs.workdir / f"{name}.json")
    argv = [*replica_command(), "serve", "--port", "0", "--health-port", "0", "--port-file", str(port_file)]
    for engine in engines:
        argv += ["--engine", engine if isinstance(engine, str) else engine.url]
    argv += ["--log-format", "json", *extra]
    proc = procs.start(name, argv, src=src)
    info = json.loads(read_port_file(port_file, proc))
    return Replica(proc, int(info["grpc"]), int(info["health"]), list(info["engines"]), info)


@dataclass
class Nginx:
    """An nginx master (`daemon off;`) balancing over replicas, run from its own prefix dir."""

    proc: Proc
    port: int
    prefix: Path

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.prefix / "nginx-access.log"

    def access_lines(self) -> list[str]:
        """The access log's lines so far (one per finished call)."""
        try:
            return self.access_log.read_text().splitlines()
        except FileNotFoundError:
            return []


def render_nginx_config(
    listen_port: int,
    upstream_ports: Sequence[int],
    workers: int = 2,
    template: Path = NGINX_TEMPLATE,
    extra: Mapping[str, str] | None = None,
) -> str:
    """A deploy template with the test's listen address, replicas and `extra` placeholders filled in."""
    # One line, so that the placeholder may also appear inside a comment of the template.
    servers = " ".join(f"server {LOOPBACK}:{p} max_fails=0;" for p in upstream_ports)
    text = (
        template.read_text()
        .replace("@WORKER_PROCESSES@", str(workers))
        .replace("@LISTEN@", f"{LOOPBACK}:{listen_port}")
        .replace("@UPSTREAM_SERVERS@", servers)
    )
    for placeholder, value in (extra or {}).items():
        text = text.replace(placeholder, value)
    return text


def start_nginx(
    procs: Processes,
    nginx: str,
    upstream_ports: Sequence[int],
    rng: random.Random,
    attempts: int = 5,
    template: Path = NGINX_TEMPLATE,
    extra: Mapping[str, str] | None = None,
    *,
    workers: int = 2,
    name: str = "nginx",
) -> Nginx:
    """nginx (`workers` worker processes) in front of `upstream_ports` on a free port below the
    ephemeral range.

    Runs as `nginx -e stderr -p PREFIX -c PREFIX/rollout-grpc.conf` with PREFIX `<workdir>/<name>`:
    the pid file, logs and temp directories land in PREFIX, nothing in the system nginx directories
    is touched, and it works unprivileged. Retries with another port when the chosen one was taken
    in the meantime.
    """
    prefix = procs.workdir / name
    prefix.mkdir(exist_ok=True)
    # As root, nginx workers run as `nobody` and must traverse the prefix to reach their temp dirs.
    prefix.chmod(0o755)
    conf = prefix / "rollout-grpc.conf"
    last = ""
    for attempt in range(attempts):
        port = free_listen_port(rng)
        conf.write_text(render_nginx_config(port, upstream_ports, workers, template=template, extra=extra))
        argv = [nginx, "-e", "stderr", "-p", f"{prefix}/", "-c", str(conf)]
        proc = procs.start(f"{name}-{attempt}", argv)
        try:
            wait_until(f"nginx on port {port}", functools.partial(tcp_accepts, port), proc)
        except StartupError as exc:
            last = str(exc)
            if "Address already in use" in proc.log_text():  # taken since the check: next port
                continue
            raise

        return Nginx(proc, port, prefix)
    raise StartupError(f"nginx did not start after {attempts} attempts; last: {last}")
