"""One worker process of `serve --workers N`: a `RolloutServer` on the shared port, plus siblings.

The worker is the console script started again by its supervisor (handshake.py): it parses the
same settings, then takes from the spec what the supervisor decided — the reserved port (bound
with SO_REUSEPORT), the shared in-flight limit (admission.py) and its share of the queue, the
engines (with `--sim`, the simulated engines the supervisor runs) — and serves until its
supervisor drains it (the same graceful stop as a replica of its own, in two phases so that every
worker stops accepting before the health port says NOT_SERVING) or until its supervisor's end of
the channel closes. Every worker serves the OpenAI front door on the port the supervisor reserved
(agent sessions are in the state store: any worker continues any session); worker 0 alone runs the
health port; no worker serves metrics (the supervisor merges theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.server.config import ServerConfig, buffer_caps, trajectory_caps, worker_share
from rollout_grpc.server.facade.calls import TimedAdmission
from rollout_grpc.server.rollout import collector
from rollout_grpc.server.rollout.control import AbortResult, AbortScope
from rollout_grpc.server.rollout.fanout import Fanout
from rollout_grpc.server.security.tls import TlsConfig
from rollout_grpc.server.state.api import BufferStore
from rollout_grpc.server.state.socket import SocketStore, SocketTrajectories
from rollout_grpc.server.state.trajectories import TrajectoryStore
from rollout_grpc.server.workers import handshake
from rollout_grpc.server.workers.admission import SharedAdmission, SharedSlots
from rollout_grpc.server.workers.control import WorkerRolloutServicer
from rollout_grpc.server.workers.handshake import WorkerSpec
from rollout_grpc.server.workers.sibling_service import start_sibling_server
from rollout_grpc.server.workers.siblings import Siblings

log = structlog.get_logger(__name__)

#: The worker that runs the health port.
HEALTH_WORKER = 0


def worker_config(config: ServerConfig, spec: WorkerSpec) -> ServerConfig:
    """`config` as worker `spec.index` of `spec.workers` serves it (a new config: it is frozen)."""
    # The in-flight limit stays the replica's: the workers count it together (admission.py).
    return dataclasses.replace(
        config,
        port=spec.port,
        reuse_port=True,
        max_queue=worker_share(config.max_queue, spec.index, spec.workers),
        # 0: half of this worker's in-flight limit plus its queue (per_caller_limit).
        max_in_flight_per_caller=worker_share(config.max_in_flight_per_caller, spec.index, spec.workers)
        if config.max_in_flight_per_caller > 0
        else 0,
        # 0: sized from this worker's admission limits.
        max_pending_calls=worker_share(config.max_pending_calls, spec.index, spec.workers)
        if config.max_pending_calls > 0
        else 0,
        metrics_port=None,
        # Every worker serves the OpenAI front door on the port the supervisor reserved (sessions are
        # in the state store); one worker runs the health port.
        openai_port=spec.openai_port,
        health_port=config.health_port if spec.index == HEALTH_WORKER else None,
    )


class WorkerServer(RolloutServer):
    """A replica's worker: control that reaches the siblings, and their private server."""

    servicer_class = WorkerRolloutServicer
    serving_event = "worker_serving"

    def __init__(self, config: ServerConfig, spec: WorkerSpec, **kwargs: Any) -> None:
        self.spec = spec  # before the base class picks the state store
        super().__init__(config, **kwargs)
        self.siblings = Siblings(spec, timeout_s=config.control_deadline_s)
        self.servicer: WorkerRolloutServicer
        self._sibling_server: grpc.aio.Server | None = None
        self.shared_admission: SharedAdmission

    def _state_store(self) -> BufferStore:
        """Without --state-store, the supervisor's embedded store: every worker shares it."""
        if self.config.state_store:
            return super()._state_store()
        return SocketStore(self.spec.state_socket, self.spec.secret, buffer_caps(self.config))

    def _trajectory_store(self) -> TrajectoryStore:
        """Without --state-store, the supervisor's sessions: every worker serves every session."""
        if self.config.state_store:
            return super()._trajectory_store()
        return SocketTrajectories(self.spec.state_socket, self.spec.secret, trajectory_caps(self.config))

    def lease_holder(self) -> str:
        """The worker's index in front of the replica's name (the lease names the worker)."""
        return f"worker {self.spec.index} of {super().lease_holder()}"

    def _admission(self, limit: int) -> TimedAdmission:
        self.shared_admission = SharedAdmission(
            SharedSlots(self.spec.run_dir, self.spec.index, self.spec.workers),
            limit,
            self.config.max_queue,
            self.config.retry_after_s,
        )
        return self.shared_admission

    def _fanouts(self, tls: TlsConfig | None) -> list[Fanout]:
        """The siblings first (their sync of Pause and Resume always; the aborts unless the store's
        bus carries them to every worker already), then the replica's own (store or peers)."""
        others = super()._fanouts(tls)
        self.siblings.store_carries_aborts = self.store_fanout is not None
        return [self.siblings, *others]

    def _build_domain(self, *args: Any, **kwargs: Any) -> WorkerRolloutServicer:
        servicer = super()._build_domain(*args, **kwargs)
        assert isinstance(servicer, WorkerRolloutServicer)
        servicer.siblings = self.siblings
        servicer.workers = self.spec.workers
        servicer.index = self.spec.index
        self.servicer = servicer
        return servicer

    async def start(self) -> None:
        await super().start()
        self.shared_admission.listen(asyncio.get_running_loop())
        self._sibling_server = await start_sibling_server(
            self, self.spec.sibling_address(self.spec.index), self.spec.secret
        )

    def sibling_paused(self, mode: str) -> int:
        """A sibling paused the engines (SyncControl)."""
        return self.control.paused_elsewhere(mode)

    async def abort_local_only(self, scope: AbortScope) -> AbortResult:
        """A sibling's abort (AbortSibling): this worker's generations only."""
        return await self.control.abort_here(scope)

    def load(self) -> pb.SiblingLoadResponse:
        """This worker's generations in flight and queued (SiblingLoad)."""
        admission = self.rollout.admission
        return pb.SiblingLoadResponse(
            in_flight=admission.running,
            queued=admission.queued,
            engine_in_flight={engine.url: engine.in_flight for engine in self.pool.engines},
        )

    def sibling_resumed(
        self, weight_version: str | None, relabelled: list[str], rotation: dict[str, str] | None = None
    ) -> None:
        """A sibling resumed the engines or updated their weights (SyncControl): relabel the engines
        that took the version, and take the rotation changes of a weight update."""
        for url, problem in (rotation or {}).items():
            engine = self.pool.get(url)
            if engine is not None:
                self.pool.set_weights_problem(engine, problem)
        if weight_version is None:
            return
        for url in relabelled:
            engine = self.pool.get(url)
            if engine is not None:
                self.pool.relabel(engine, weight_version)
        # The version order is the fleet's, in the state store: the sibling advanced it there.

    async def finish_stop(self) -> None:
        if self._finishing:
            return
        await super().finish_stop()
        if self._sibling_server is not None:
            await self._sibling_server.stop(None)
        await self.siblings.close()


def _settle_collector() -> None:
    """The collector set for serving, once this worker listens (`collector.settle_after_start`)."""
    frozen, threshold = collector.settle_after_start()
    log.info("collector_settled", frozen_objects=frozen, gen0_threshold=threshold)


async def serve_worker(server: WorkerServer, sock: socket.socket, on_sighup: Callable[[], None]) -> int:
    """Start `server`, answer the handshake, serve until the supervisor drains it; the exit code.

    The drain comes in two phases over the socket pair (handshake.py): `stop_accepting` (answered
    once this worker refuses new calls), then `finish` (health NOT_SERVING, grace, aborts). A
    signal that reaches the worker itself is passed to the supervisor, which drains every worker
    alike; when the supervisor is gone (end-of-file) the worker stops on its own."""
    loop = asyncio.get_running_loop()
    # Every handler before the start (the default actions kill): a signal that comes meanwhile
    # waits here and is acted on once the worker serves (SIGHUP) or its link is open (SIGTERM,
    # SIGINT: the supervisor drains the replica).
    early: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, early.append, sig)
    try:
        await server.start()
    except Exception as exc:  # reported by the supervisor as one line (ports, exposure, ...)
        sock.sendall(handshake.encode({"error": str(exc) or type(exc).__name__}))
        with contextlib.suppress(Exception):
            await server.stop()
        return 1
    # Before "ready": the supervisor forwards SIGHUP only to ready workers.
    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    if signal.SIGHUP in early:
        on_sighup()
    try:
        sock.sendall(
            handshake.encode(
                {
                    "ready": True,
                    "pid": os.getpid(),
                    "health_port": server.health_port,
                    "openai_port": server.openai_port,
                    "in_flight_limit": server.config.in_flight_limit(),
                }
            )
        )
    except OSError:  # the supervisor closed its end (a stop during this start): stop quietly
        await server.stop()
        return 0
    _settle_collector()
    link = await handshake.DrainLink.open(sock)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _pass_signal, link, sig)
    stops = [sig for sig in early if sig != signal.SIGHUP]
    if stops:
        _pass_signal(link, stops[0])
    try:
        if not await _next_phase(link, handshake.STOP_ACCEPTING):
            await server.stop()
            return 0
        log.info("shutdown_requested")
        # The supervisor waits at most one control deadline for every worker's answer.
        await server.stop_accepting(phase_gap_s=server.config.control_deadline_s)
        log.info("stopped_accepting")
        link.send({handshake.STOPPED_ACCEPTING: True})
        await _next_phase(link, handshake.FINISH)
        await server.finish_stop()
        return 0
    finally:
        link.close()


def _pass_signal(link: handshake.DrainLink, sig: signal.Signals) -> None:
    """A SIGTERM/SIGINT sent to this worker itself: the supervisor drains the whole replica."""
    log.info("signal_passed_to_supervisor", signal=sig.name)
    link.send({handshake.STOP_REQUESTED: sig.name})


async def _next_phase(link: handshake.DrainLink, phase: str) -> bool:
    """Wait for the supervisor's `phase`; False when the supervisor is gone (end-of-file)."""
    while True:
        message = await link.receive()
        if message is None:
            log.warning("supervisor_gone", action="stopping", waiting_for=phase)
            return False
        if message.get(handshake.DRAIN) == phase:
            return True
        log.warning("unexpected_supervisor_message", message=message, waiting_for=phase)
