"""The `serve --workers N` supervisor: N worker processes on one port, one replica outside.

It reserves the gRPC port (reservation.py), creates a 0700 run directory for the workers'
private sockets and a per-start random sibling secret, starts the workers as subprocesses of the
same console script (handshake.py says why), and waits until each reported ready on its socket
pair (never a sleep). It then checks that every listener on the port is a worker's (a stranger is
fatal), logs one `serving` line, serves the merged `--metrics-port` and writes `--port-file`.

In steady state it only waits: for a signal, a worker's exit, or the listener re-check timer.

* SIGTERM / SIGINT (to the supervisor, or to a worker, which passes it on): the drain, in two
  phases over the socket pairs (handshake.py): every worker stops accepting and answers (at most
  one control deadline), then every worker finishes as a replica of its own does (health
  NOT_SERVING, grace, in-flight streams end with their samples) within the replica's shutdown
  bound; workers still running past it (plus a margin) are killed. So worker 0's health port
  never says NOT_SERVING while a sibling still accepts calls. Exit 0.
* SIGHUP: forwarded; every worker re-reads the engines file and the tokens file.
* A worker that exits unexpectedly (a crash, SIGKILL, the OOM killer) is replaced: the others
  keep serving; the slots the dead worker held in the shared in-flight limit are given back
  (`admission.reclaim_slots`), its stale sockets removed, and a new worker with the same index
  starts after an exponential back-off (`RestartPolicy`: 0.5 s, 1 s, 2 s, ... at most 10 s). More
  than `--worker-restarts` replacements within `--worker-restart-window` seconds means the worker
  cannot stay up (a bad engine list, a broken node): the supervisor then logs
  `worker_restart_limit`, stops the others gracefully and exits 1, to be restarted whole by
  whatever runs it. What a client of the dead worker sees: docs/workers.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from rollout_grpc.server.config import ServerConfig, buffer_caps, trajectory_caps
from rollout_grpc.server.ports import PortUnavailable
from rollout_grpc.server.state.memory import MemoryStore
from rollout_grpc.server.state.socket import serve_store
from rollout_grpc.server.state.trajectories import MemoryTrajectories
from rollout_grpc.server.workers import handshake
from rollout_grpc.server.workers.admission import create_slots, reclaim_slots
from rollout_grpc.server.workers.handshake import WorkerSpec
from rollout_grpc.server.workers.metrics import MergedMetricsEndpoint, WorkerScraper
from rollout_grpc.server.workers.reservation import PortReservation, foreign_listeners

log = structlog.get_logger(__name__)

#: Seconds between re-checks that nobody else listens on the port.
LISTENER_CHECK_S = 10.0
#: Seconds past the shutdown bound before a worker that has not stopped is killed.
KILL_MARGIN_S = 5.0
#: Longest a unix socket path may be (sun_path).
MAX_SOCKET_PATH = 107


#: Replacements of dead workers allowed within `RESTART_WINDOW_S` before the replica stops.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: The first replacement's delay, doubled for each replacement in the window, at most the cap.
RESTART_DELAY_S = 0.5
RESTART_DELAY_CAP_S = 10.0


@dataclass
class RestartPolicy:
    """When to replace a dead worker: exponential back-off, and a cap on replacements per window.

    The back-off keeps a worker that dies at once (a poisoned config, an engine that crashes it)
    from spinning; the cap turns a worker that cannot stay up into one visible failure of the
    replica instead of endless restarts.
    """

    max_restarts: int = MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    delay_s: float = RESTART_DELAY_S
    delay_cap_s: float = RESTART_DELAY_CAP_S
    _times: deque[float] = field(default_factory=deque)

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next replacement, or None when the cap is reached."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return None
        self._times.append(now)
        return min(self.delay_cap_s, self.delay_s * 2.0 ** (len(self._times) - 1))


class SupervisorError(Exception):
    """The replica cannot start: one line for `rollout-grpc serve:` to print."""


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    channel: socket.socket
    ready: dict[str, object] = field(default_factory=dict)
    #: The socket pair after the handshake (None until the worker reported ready).
    link: handshake.DrainLink | None = None
    #: Set when the worker answered the drain's first phase, or its end closed (it is exiting).
    stopped_accepting: asyncio.Event = field(default_factory=asyncio.Event)
    #: A SIGHUP came before the worker was ready: sent once it is (`Supervisor._forward`).
    sighup_pending: bool = False


#: The cgroup v2 CPU limit of this process's container ("max" or "<quota> <period>").
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def cgroup_cpus(path: str = CGROUP_CPU_MAX) -> int | None:
    """CPUs a cgroup v2 quota allows (rounded up), None without a quota."""
    try:
        quota, _, period = Path(path).read_text().strip().partition(" ")
    except OSError:
        return None
    if quota == "max" or not period:
        return None
    try:
        return max(1, -(-int(quota) // int(period)))
    except ValueError:
        return None


def default_workers() -> int:
    """The cores this process may run on: its CPU affinity, capped by a container's CPU quota
    (a pod limited to 2 CPUs on a 64-core node sees 64 cores in its affinity)."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpus()
    return min(cores, quota) if quota is not None else cores


class Supervisor:
    """Runs the workers of one replica."""

    def __init__(
        self,
        config: ServerConfig,
        workers: int,
        serve_argv: Sequence[str],
        *,
        simulated: bool,
        port_file: str | None = None,
        restarts: RestartPolicy | None = None,
    ) -> None:
        self.config = config
        self.workers = workers
        self.serve_argv = list(serve_argv)
        self.simulated = simulated
        self.port_file = port_file
        self._workers: list[_Worker] = []
        self._metrics: MergedMetricsEndpoint | None = None
        self._scraper: WorkerScraper | None = None
        self.metrics_port: int | None = None
        self.port = 0
        #: The OpenAI front door's port every worker shares (None: the front door is off).
        self.openai_port: int | None = None
        self._run_dir = ""
        self._stop = asyncio.Event()
        self._listeners: list[asyncio.Task[None]] = []
        self._specs: list[WorkerSpec] = []
        #: The embedded state store every worker reaches (without --state-store): it outlives
        #: any worker, so a worker's restart loses no caller's buffer.
        self._state_server: asyncio.Server | None = None
        self.restarts = restarts or RestartPolicy(config.worker_restarts, config.worker_restart_window_s)

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "rollout_grpc._entry", "serve", *self.serve_argv]

    async def _spawn(self, spec: WorkerSpec) -> _Worker:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env[handshake.WORKER_FD_VARIABLE] = str(theirs.fileno())
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command(), env=env, pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL
            )
        finally:
            theirs.close()
        ours.sendall(handshake.spec_message(spec))
        return _Worker(spec.index, process, ours)

    async def _await_ready(self, worker: _Worker) -> None:
        """The worker's ready line; SupervisorError with its message when it failed or exited."""
        loop = asyncio.get_running_loop()
        message = await loop.run_in_executor(None, handshake.read_line, worker.channel)
        if message is None:
            code = await worker.process.wait()
            raise SupervisorError(f"worker {worker.index} exited with {code} before it was ready")
        if "error" in message:
            raise SupervisorError(str(message["error"]))
        worker.ready = message
        if worker.sighup_pending:  # it may have read its files before they changed
            worker.sighup_pending = False
            self._signal(worker, signal.SIGHUP)

    async def run(self) -> int:
        """Start, serve until a signal or a worker's exit, stop; the exit code."""
        cfg = self.config
        try:
            reservation = PortReservation(cfg.host, cfg.port)
        except PortUnavailable as exc:
            raise SupervisorError(str(exc)) from None
        # Every worker serves the OpenAI front door too, on one port reserved alike.
        front_door: PortReservation | None = None
        if cfg.openai_port is not None:
            try:
                front_door = PortReservation(
                    cfg.host, cfg.openai_port, "the OpenAI front door, --openai-port"
                )
            except PortUnavailable as exc:
                reservation.close()
                raise SupervisorError(str(exc)) from None
        try:
            run_dir = tempfile.mkdtemp(prefix="rollout-grpc-")  # mode 0700
        except OSError as exc:
            reservation.close()
            if front_door is not None:
                front_door.close()
            raise SupervisorError(
                f"cannot create the workers' run directory in {tempfile.gettempdir()} ({exc.strerror}): "
                "set TMPDIR to a writable directory"
            ) from None
        try:
            with reservation, front_door or contextlib.nullcontext():
                self.port = reservation.port
                self.openai_port = front_door.port if front_door is not None else None
                # The replica's one in-flight limit, counted by all workers together.
                create_slots(run_dir, cfg.in_flight_limit(), self.workers)
                return await self._run(run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    async def _run(self, run_dir: str) -> int:
        self._run_dir = run_dir
        secret = secrets.token_urlsafe(32)
        specs = [
            WorkerSpec(
                index=i,
                workers=self.workers,
                port=self.port,
                openai_port=self.openai_port,
                run_dir=run_dir,
                secret=secret,
                engines=list(self.config.engines),
                engine_kinds=dict(self.config.engine_kinds),
                simulated=self.simulated,
            )
            for i in range(self.workers)
        ]
        self._specs = specs
        if len(specs[-1].sibling_socket(self.workers - 1)) > MAX_SOCKET_PATH:
            raise SupervisorError(f"the run directory {run_dir} is too long for unix sockets (set TMPDIR)")
        if not self.config.state_store:
            store = MemoryStore(buffer_caps(self.config))
            sessions = MemoryTrajectories(trajectory_caps(self.config))
            self._state_server = await serve_store(specs[0].state_socket, secret, store, sessions)
        loop = asyncio.get_running_loop()
        stop = self._stop
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        try:
            self._workers = [await self._spawn(spec) for spec in specs]
            await self._start(specs)
        except BaseException:
            await self._stop_workers()
            await self._close()
            raise
        stopping = asyncio.ensure_future(stop.wait())
        checks = asyncio.ensure_future(self._check_listeners_forever())
        try:
            code = await self._supervise(stopping)
        finally:
            checks.cancel()
        if code == 0:
            log.info("shutdown_requested", workers=self.workers)
        stopping.cancel()
        await self._stop_workers()
        await self._close()
        log.info("stopped", workers=self.workers)
        return code

    async def _supervise(self, stopping: asyncio.Future[Any]) -> int:
        """Until a stop is requested (0) or a dead worker cannot be replaced (1): replace every
        worker that exits."""
        while True:
            exits: dict[asyncio.Future[Any], _Worker] = {
                asyncio.ensure_future(w.process.wait()): w for w in self._workers
            }
            waits: list[asyncio.Future[Any]] = [stopping, *exits]
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in exits:
                    task.cancel()
            if stopping in done:
                return 0
            for task in done:
                if not await self._replace(exits[task], stopping):
                    return 0 if stopping.done() else 1

    async def _replace(self, dead: _Worker, stopping: asyncio.Future[Any]) -> bool:
        """Replace the dead worker (again, with back-off, if the replacement fails to start); False
        when the restart cap is reached or a stop was requested meanwhile."""
        code = dead.process.returncode
        self._retire(dead)
        while True:
            delay = self.restarts.next_delay(time.monotonic())
            if delay is None:
                log.error(
                    "worker_restart_limit",
                    worker=dead.index,
                    pid=dead.process.pid,
                    code=code,
                    restarts=self.restarts.max_restarts,
                    window_s=self.restarts.window_s,
                    action="a worker keeps dying: stopping the other workers; the replica exits 1",
                )
                return False
            log.error(
                "worker_exited",
                worker=dead.index,
                pid=dead.process.pid,
                code=code,
                action=f"replacing it in {delay:g} s; the other workers keep serving",
            )
            try:
                await asyncio.wait_for(asyncio.shield(stopping), delay)
                return False  # a stop was requested during the back-off
            except TimeoutError:
                pass
            try:
                worker = await self._respawn(dead.index, stopping)
            except SupervisorError as exc:
                log.error("worker_restart_failed", worker=dead.index, error=str(exc))
                failed = self._workers[dead.index]
                code = await failed.process.wait()
                self._retire(failed)
                continue
            if worker is None:
                return False
            log.info(
                "worker_restarted", worker=worker.index, pid=worker.process.pid, replaced_pid=dead.process.pid
            )
            self._write_port_file()
            return True

    def _retire(self, dead: _Worker) -> None:
        """Forget a dead worker's state: its slots in the shared limit, its sockets, its link."""
        given_back = reclaim_slots(self._run_dir, dead.index, self.workers)
        if given_back:
            log.warning("worker_slots_reclaimed", worker=dead.index, slots=given_back)
        if dead.link is not None:
            dead.link.close()
        dead.channel.close()
        spec = self._specs[dead.index]
        for path in (spec.sibling_socket(dead.index), str(Path(self._run_dir) / f"wake-{dead.index}")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def _respawn(self, index: int, stopping: asyncio.Future[Any]) -> _Worker | None:
        """A new worker in slot `index`, ready and linked; None when a stop came first."""
        worker = await self._spawn(self._specs[index])
        self._workers[index] = worker
        ready: asyncio.Future[Any] = asyncio.ensure_future(self._await_ready(worker))
        await asyncio.wait([ready, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            # The drain that follows stops this worker as any other not yet ready.
            ready.cancel()
            return None
        ready.result()  # SupervisorError when it failed
        worker.link = await handshake.DrainLink.open(worker.channel)
        self._listeners.append(asyncio.ensure_future(self._listen(worker, worker.link)))
        return worker

    async def _start(self, specs: list[WorkerSpec]) -> None:
        waits = [asyncio.ensure_future(self._await_ready(w)) for w in self._workers]
        try:
            for wait in asyncio.as_completed(waits):
                await wait
        finally:
            for wait in waits:
                wait.cancel()
        for worker in self._workers:
            worker.link = await handshake.DrainLink.open(worker.channel)
            self._listeners.append(asyncio.ensure_future(self._listen(worker, worker.link)))
        pids = [w.process.pid for w in self._workers]
        for port, what in self._shared_ports():
            foreign = foreign_listeners(port, pids)
            if foreign:
                raise SupervisorError(
                    f"cannot listen on {self.config.host}:{port} ({what}): another process "
                    f"listens there with SO_REUSEPORT too (socket inodes {sorted(foreign)}; `ss -ltnpe` "
                    "names it)"
                )
        self._scraper = WorkerScraper(
            [specs[0].sibling_address(i) for i in range(self.workers)], specs[0].secret
        )
        cfg = self.config
        if cfg.metrics_port is not None:
            self._metrics = MergedMetricsEndpoint(self._scraper, self.workers, self.check_listeners)
            try:
                self.metrics_port = await self._metrics.start(cfg.host, cfg.metrics_port)
            except OSError as exc:
                from rollout_grpc.server import ports

                raise SupervisorError(
                    str(ports.unavailable("metrics, --metrics-port", cfg.host, cfg.metrics_port, exc))
                ) from None
        first = self._workers[0].ready
        log.info(
            "serving",
            port=self.port,
            workers=self.workers,
            worker_pids=pids,
            health_port=first.get("health_port"),
            openai_port=first.get("openai_port"),
            metrics_port=self.metrics_port,
            simulated_engines=self.simulated or None,
            engines=list(cfg.engines),
            # The replica's one limit, counted by the workers together (admission.py).
            in_flight_limit=cfg.in_flight_limit(),
        )
        self._write_port_file()

    def _write_port_file(self) -> None:
        """`--port-file` (again after a worker was replaced: its pid, and worker 0's side ports)."""
        if not self.port_file:
            return
        first = self._workers[0].ready
        tmp = self.port_file + ".tmp"
        Path(tmp).write_text(
            json.dumps(
                {
                    "grpc": self.port,
                    "health": first.get("health_port"),
                    "openai": first.get("openai_port"),
                    "metrics": self.metrics_port,
                    "engines": list(self.config.engines),
                    "workers": self.workers,
                    "worker_pids": [w.process.pid for w in self._workers],
                    "supervisor_pid": os.getpid(),
                    # The 0700 directory of the workers' sockets (reaching them needs the secret).
                    "run_dir": self._run_dir,
                }
            )
        )
        os.replace(tmp, self.port_file)

    async def _check_listeners_forever(self) -> None:
        """Every LISTENER_CHECK_S: log and count listeners on the port that are not the workers'."""
        while True:
            await asyncio.sleep(LISTENER_CHECK_S)
            self.check_listeners()

    def _shared_ports(self) -> list[tuple[int, str]]:
        """The ports every worker listens on (SO_REUSEPORT), each with how errors name it."""
        shared = [(self.port, "gRPC, --port")]
        if self.openai_port is not None:
            shared.append((self.openai_port, "the OpenAI front door, --openai-port"))
        return shared

    def check_listeners(self) -> int:
        """Listeners on the shared ports no worker holds (logged as an error, exposed as a metric)."""
        pids = [w.process.pid for w in self._workers]
        count = 0
        for port, _ in self._shared_ports():
            foreign = foreign_listeners(port, pids)
            if foreign:
                log.error(
                    "foreign_listener",
                    port=port,
                    inodes=sorted(foreign),
                    error="another process listens on the replica's port with SO_REUSEPORT and "
                    "receives a share of its connections (`ss -ltnpe` names it)",
                )
            count += len(foreign)
        return count

    async def _listen(self, worker: _Worker, link: handshake.DrainLink) -> None:
        """A worker's messages after the handshake: its answer to the drain, a signal it got."""
        while (message := await link.receive()) is not None:
            if handshake.STOPPED_ACCEPTING in message:
                worker.stopped_accepting.set()
            elif handshake.STOP_REQUESTED in message:
                log.info(
                    "stop_requested_by_worker", worker=worker.index, signal=message[handshake.STOP_REQUESTED]
                )
                self._stop.set()
        worker.stopped_accepting.set()  # its end closed: it is exiting, its listener with it

    def _forward(self, sig: signal.Signals) -> None:
        """Send `sig` to every live worker. A SIGHUP waits for a worker that is not ready yet: a
        worker installs its SIGHUP handler before it says ready, and SIGHUP's default action would
        kill it (with whatever it serves)."""
        held: list[int] = []
        for worker in self._workers:
            if sig == signal.SIGHUP and not worker.ready:
                worker.sighup_pending = True
                held.append(worker.index)
            else:
                self._signal(worker, sig)
        if sig == signal.SIGHUP:
            log.info("sighup_forwarded", workers=self.workers, held_until_ready=held)

    @staticmethod
    def _signal(worker: _Worker, sig: signal.Signals) -> None:
        if worker.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(sig)

    async def _stop_workers(self) -> None:
        """Drain every worker in two phases, wait within the shutdown bound, kill what is left."""
        linked = [w for w in self._workers if w.link is not None]
        for worker in self._workers:
            if worker.link is None:  # not ready yet (a failed start): a plain stop
                with contextlib.suppress(ProcessLookupError):
                    if worker.process.returncode is None:
                        worker.process.send_signal(signal.SIGTERM)
                worker.channel.close()  # if it got ready meanwhile, end-of-file stops it
        await self._stop_accepting(linked)
        for worker in linked:
            assert worker.link is not None
            worker.link.send({handshake.DRAIN: handshake.FINISH})
        # Phase 1 is behind us: from here each worker's own (one-process) bound applies.
        bound = self.config.shutdown_bound_s() + KILL_MARGIN_S
        waits = [w.process.wait() for w in self._workers]
        try:
            async with asyncio.timeout(bound):
                await asyncio.gather(*waits)
        except TimeoutError:
            log.error("worker_stop_timeout", seconds=bound, action="killing")
            self._forward(signal.SIGKILL)
            await asyncio.gather(*(w.process.wait() for w in self._workers))
        for task in self._listeners:
            task.cancel()
        await asyncio.gather(*self._listeners, return_exceptions=True)
        for worker in self._workers:
            if worker.link is not None:
                worker.link.close()
            worker.channel.close()

    async def _stop_accepting(self, workers: list[_Worker]) -> None:
        """The drain's first phase: every worker refuses new calls (GOAWAY, listener closed) and
        answers, before any worker's health says NOT_SERVING. A worker that does not answer
        within one control deadline is logged and the drain goes on (the stop stays bounded)."""
        for worker in workers:
            assert worker.link is not None
            worker.link.send({handshake.DRAIN: handshake.STOP_ACCEPTING})
        answers = {asyncio.ensure_future(w.stopped_accepting.wait()): w for w in workers}
        if not answers:
            return
        wait_s = self.config.control_deadline_s
        _, silent = await asyncio.wait(answers, timeout=wait_s)
        for task in silent:
            task.cancel()
        if silent:
            log.error(
                "worker_stop_accepting_timeout",
                workers=sorted(answers[t].index for t in silent),
                seconds=wait_s,
                action="draining anyway: the health port may say NOT_SERVING while they accept",
            )

    async def _close(self) -> None:
        if self._state_server is not None:
            self._state_server.close()
        if self._metrics is not None:
            await self._metrics.stop()
        if self._scraper is not None:
            await self._scraper.close()
