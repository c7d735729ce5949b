"""Real vLLM servers for the conformance tier: start on first use, share for the session, stop by group.

Each server is ``tools/vllm/serve.sh KIND PORT`` (``vllm serve`` on 127.0.0.1 with the tier's flags),
started in its own process group so that stopping it ends the API server, EngineCore and Worker
together. Use :func:`vllm_url` (or the pytest fixtures in ``tests/vllm/fixtures.py``).

Environment:

* ``ROLLOUT_VLLM=1`` enables the tier (``tools/vllm/run_tier.sh`` sets it); without it nothing starts.
* ``ROLLOUT_VLLM_CACHE`` (default ``<repo>/.cache``) holds ``vllm-venv``, ``vllm-models``, ``vllm-logs``.
* ``ROLLOUT_VLLM_MAX_SERVERS`` (default 2): at most this many servers run at once; starting another
  stops the least recently used one that the current test does not need (it restarts on the same port
  when needed again). Each server is about 3 GiB RSS.
* ``ROLLOUT_VLLM_START_TIMEOUT`` (default 300 s): deadline for ``/health`` to answer 200.
* ``ROLLOUT_VLLM_PIDFILE_DIR``: when set, a file per running server holds its process-group id, so
  that ``run_tier.sh`` can stop leftovers if the test process is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, get_args

ModelKind = Literal["dense", "moe", "vl"]
MODEL_KINDS: tuple[ModelKind, ...] = get_args(ModelKind)

# Served model names (``--served-model-name``) and context lengths, as set by tools/vllm/serve.sh.
SERVED_NAMES: dict[ModelKind, str] = {"dense": "tiny-llama", "moe": "tiny-qwen3moe", "vl": "tiny-qwen2vl"}
MAX_MODEL_LEN: dict[ModelKind, int] = {"dense": 4096, "moe": 4096, "vl": 1024}

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE_SCRIPT = REPO_ROOT / "tools" / "vllm" / "serve.sh"
ENABLE_ENV = "ROLLOUT_VLLM"


class VllmStartError(RuntimeError):
    """A server did not become healthy; the message carries the end of its log."""


def tier_enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "") not in ("", "0", "false", "no")


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_VLLM_CACHE") or REPO_ROOT / ".cache")


def skip_reason() -> str | None:
    """Why the live tier cannot run here, or None when it can."""
    if not tier_enabled():
        return f"{ENABLE_ENV} is not set: the live vLLM tier runs with `make test-vllm`"
    cache = cache_dir()
    if not (cache / "vllm-venv" / "bin" / "vllm").exists():
        return f"no vLLM venv in {cache}: run tools/vllm/install.sh (make test-vllm does)"
    if not (cache / "vllm-models" / ".rollout-built").exists():
        return f"no tiny models in {cache}: run tools/vllm/build_models.sh (make test-vllm does)"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is fine
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class VllmServer:
    """One ``vllm serve`` process group."""

    kind: ModelKind
    port: int
    log_path: Path
    pidfile_dir: Path | None = None
    #: More `vllm serve` flags after the tier's (e.g. ``--no-enable-prefix-caching``; bench/step_n.py).
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started_s: float = 0.0  # seconds from spawn until /health answered 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pgid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout_s: float) -> None:
        """Spawn the server and wait until ``/health`` answers 200; on failure stop it and raise."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log: IO[bytes]
        with self.log_path.open("ab") as log:
            log.write(f"\n==== starting {self.kind} on port {self.port} ====\n".encode())
            log.flush()
            begin = time.monotonic()
            self.process = subprocess.Popen(
                ["bash", str(SERVE_SCRIPT), self.kind, str(self.port), *self.extra_args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=True,  # its own process group: killpg ends the whole tree
            )
        self._write_pidfile()
        try:
            self._wait_healthy(begin + timeout_s)
            self._warm_up_logprobs(begin + timeout_s)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - begin

    def _warm_up_logprobs(self, deadline: float) -> None:
        """Generate two tokens with logprobs once, before any test runs.

        vLLM's sampler computes token ranks with a `torch.compile`d function
        (`vllm/v1/sample/ops/logprobs.py: batched_count_greater_than`, inductor on CPU, even with
        `--enforce-eager`), compiled in the first engine step that returns logprobs: a C++ build on
        a loaded machine takes seconds to tens of seconds. A `/pause` is an engine-core utility
        call run between steps, so an Abort(all) sent during that first step waited for the
        compile (py-spy: EngineCore in `EngineCore.step -> sample_tokens`, the worker in
        `Sampler.gather_logprobs -> torch._inductor ... VecISA._probe_load`); the tier's image
        test then missed its deadline. The warm-up pays the compile at start, outside any test.
        """
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as response:
            model = json.loads(response.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "warm up", "max_tokens": 2, "logprobs": 1}).encode()
        request = urllib.request.Request(
            f"{self.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())) as response:
            if response.status != 200:
                raise VllmStartError(f"vLLM {self.kind} warm-up answered {response.status}")

    def _wait_healthy(self, deadline: float) -> None:
        assert self.process is not None
        while True:
            code = self.process.poll()
            if code is not None:
                raise VllmStartError(
                    f"vLLM {self.kind} server exited with {code} before /health answered; "
                    f"log {self.log_path}:\n{_log_tail(self.log_path)}"
                )
            if self.healthy(timeout_s=2.0):
                return
            if time.monotonic() > deadline:
                raise VllmStartError(
                    f"vLLM {self.kind} server not healthy before the deadline; "
                    f"log {self.log_path}:\n{_log_tail(self.log_path)}"
                )
            time.sleep(0.5)  # polling interval of a startup deadline, not test synchronisation

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def rss_mib(self) -> dict[str, float]:
        """Resident memory per process of the group, ``"<pid> <name>" -> MiB``."""
        result: dict[str, float] = {}
        if self.pgid is None:
            return result
        for pid in _group_members(self.pgid):
            with contextlib.suppress(OSError, ValueError):
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
                fields = dict(line.split(":", 1) for line in status if ":" in line)
                if "VmRSS" in fields:
                    kib = int(fields["VmRSS"].split()[0])
                    result[f"{pid} {fields['Name'].strip()}"] = kib / 1024
        return result

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``grace_s``; idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        pgid = process.pid
        try:
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while _group_alive(pgid) and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=0.2)
            if _group_alive(pgid):
                _signal_group(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5.0)
        finally:
            self._remove_pidfile(pgid)

    def _pidfile(self, pgid: int) -> Path | None:
        return self.pidfile_dir / f"{self.kind}-{pgid}.pgid" if self.pidfile_dir else None

    def _write_pidfile(self) -> None:
        if self.pgid is not None and (path := self._pidfile(self.pgid)) is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{self.pgid}\n")

    def _remove_pidfile(self, pgid: int) -> None:
        if (path := self._pidfile(pgid)) is not None:
            path.unlink(missing_ok=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg: treat a group whose members are all zombies as gone.
    return any(_state(pid) not in ("Z", "X", "") for pid in _group_members(pgid))


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if os.getpgid(int(entry.name)) == pgid:
                    members.append(int(entry.name))
    return members


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


class VllmServerManager:
    """Starts servers lazily, at most ``max_servers`` at once, and stops them all at the end."""

    def __init__(
        self,
        *,
        log_dir: Path,
        max_servers: int = 2,
        start_timeout_s: float = 300.0,
        pidfile_dir: Path | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.max_servers = max(1, max_servers)
        self.start_timeout_s = start_timeout_s
        self.pidfile_dir = pidfile_dir
        self._servers: dict[ModelKind, VllmServer] = {}
        self._ports: dict[ModelKind, int] = {}  # kept across restarts so handed-out URLs stay valid
        self._last_used: dict[ModelKind, float] = {}
        self._failed: dict[ModelKind, str] = {}  # a kind that failed to start is not retried
        self._lock = threading.RLock()
        self.events: list[str] = []  # start times and memory, for the end-of-session summary
        self.starts: dict[ModelKind, int] = dict.fromkeys(MODEL_KINDS, 0)  # healthy starts per kind

    @classmethod
    def from_env(cls) -> VllmServerManager:
        pidfile_dir = os.environ.get("ROLLOUT_VLLM_PIDFILE_DIR")
        return cls(
            log_dir=cache_dir() / "vllm-logs",
            max_servers=int(os.environ.get("ROLLOUT_VLLM_MAX_SERVERS", "2")),
            start_timeout_s=float(os.environ.get("ROLLOUT_VLLM_START_TIMEOUT", "300")),
            pidfile_dir=Path(pidfile_dir) if pidfile_dir else None,
        )

    def url(self, kind: ModelKind, *, keep: Iterable[ModelKind] = ()) -> str:
        """The base URL of a healthy server for ``kind``, starting it (and evicting others) if needed."""
        if kind not in MODEL_KINDS:
            raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")
        with self._lock:
            if kind in self._failed:
                raise VllmStartError(f"(not retried) {self._failed[kind]}")
            self._last_used[kind] = time.monotonic()
            server = self._servers.get(kind)
            if server is not None and server.running():
                return server.url
            if server is not None:  # it died: start a fresh one on the same port
                server.stop()
                del self._servers[kind]
            self._evict(needed={kind, *keep})
            server = self._new_server(kind)
            self._servers[kind] = server
            try:
                server.start(self.start_timeout_s)
            except VllmStartError as exc:
                del self._servers[kind]
                self._failed[kind] = str(exc)
                raise
            except BaseException:  # interrupted or timed out from outside: may be retried
                del self._servers[kind]
                raise
            self.starts[kind] += 1
            self.events.append(f"{kind}: healthy after {server.started_s:.1f} s on {server.url}")
            return server.url

    def ensure(self, kinds: Iterable[ModelKind]) -> None:
        """Start every kind in ``kinds`` (used before a test runs, outside its timeout)."""
        needed = list(dict.fromkeys(kinds))
        for kind in needed:
            self.url(kind, keep=needed)

    def server(self, kind: ModelKind) -> VllmServer | None:
        with self._lock:
            return self._servers.get(kind)

    def running_kinds(self) -> list[ModelKind]:
        with self._lock:
            return [kind for kind, server in self._servers.items() if server.running()]

    def stop(self, kind: ModelKind) -> None:
        with self._lock:
            server = self._servers.pop(kind, None)
        if server is not None:
            self._stop(server)

    def stop_all(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            self._stop(server)

    def _stop(self, server: VllmServer) -> None:
        rss = server.rss_mib()
        if rss:
            parts = ", ".join(f"{name.split(' ', 1)[1]} {mib:.0f}" for name, mib in sorted(rss.items()))
            self.events.append(f"{server.kind}: stopping, RSS {sum(rss.values()):.0f} MiB ({parts})")
        server.stop()

    def _evict(self, needed: set[ModelKind]) -> None:
        running = [kind for kind, server in self._servers.items() if server.running()]
        candidates = sorted(
            (kind for kind in running if kind not in needed), key=lambda k: self._last_used.get(k, 0.0)
        )
        excess = len(running) + 1 - self.max_servers
        for kind in candidates[: max(0, excess)]:
            self.stop(kind)

    def _new_server(self, kind: ModelKind) -> VllmServer:
        port = self._ports.get(kind)
        if port is None or not _port_is_free(port):
            port = free_port()
        self._ports[kind] = port
        return VllmServer(
            kind=kind,
            port=port,
            log_path=self.log_dir / f"{kind}-{os.getpid()}.log",
            pidfile_dir=self.pidfile_dir,
        )


_manager: VllmServerManager | None = None
_manager_lock = threading.Lock()


def manager() -> VllmServerManager:
    """The process-wide manager; its servers are stopped at interpreter exit at the latest."""
    global _manager  # noqa: PLW0603 - one manager per test process, created on first use
    with _manager_lock:
        if _manager is None:
            _manager = VllmServerManager.from_env()
            atexit.register(_manager.stop_all)
        return _manager


def vllm_url(model: ModelKind) -> str:
    """Base URL (``http://127.0.0.1:PORT``) of the session's server for ``model``, started on first use.

    Raises RuntimeError when the tier is not enabled (``ROLLOUT_VLLM`` unset) or not installed.
    """
    reason = skip_reason()
    if reason is not None:
        raise RuntimeError(reason)
    return manager().url(model)
