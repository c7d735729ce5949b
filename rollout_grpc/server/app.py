"""Assembles and runs one service replica: gRPC server, health, reflection, engines, shutdown.

Health (`grpc.health.v1`) is served on the main port and on a separate port of its own, so probes
still answer when the rollout RPCs are saturated (no `maximum_concurrent_rpcs` is used: admission
control is per generation, see `admission.py`). The service name's status follows engine
availability: SERVING while at least one engine is usable, NOT_SERVING otherwise and during
shutdown; "" (liveness) stays SERVING while the process runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server import domain
from rollout_grpc.server.admission import Admission
from rollout_grpc.server.control import Control
from rollout_grpc.server.engines import EnginePool
from rollout_grpc.server.inflight import InFlightRegistry
from rollout_grpc.server.peers import PeerAborter
from rollout_grpc.server.render import RenderService
from rollout_grpc.server.rollout import Rollout, RolloutConfig
from rollout_grpc.server.service import RolloutServicer
from rollout_grpc.server.vllm import EngineTimeouts

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name


def rollout_num_engines(num_gpus: int | None, gpus_per_engine: int, engine_urls: int) -> int:
    """Engine count as slime's `get_rollout_num_engines`, never 0.

    With a GPU count, `max(1, num_gpus // gpus_per_engine)`; without one (external engines), the
    number of engine URLs. slime returns 0 for zero GPUs, which makes a zero-size semaphore and a
    deadlock; here at least one engine's worth of concurrency is always allowed.
    """
    if num_gpus is not None and num_gpus > 0:
        return max(1, num_gpus // max(1, gpus_per_engine))
    return max(1, engine_urls)


@dataclass(slots=True)
class ServerConfig:
    """Everything a replica needs to start."""

    engines: list[str]
    host: str = "127.0.0.1"
    port: int = 50051
    #: Separate health port (0 = pick a free one, None = health on the main port only).
    health_port: int | None = 0
    server_concurrency: int = 512
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int = 1
    max_queue: int = 4096
    retry_after_s: float = 1.0
    grace_s: float = 30.0
    abort_grace_s: float = 10.0
    health_interval_s: float = 2.0
    breaker_cooldown_s: float = 5.0
    engine_connect_timeout_s: float = 5.0
    engine_read_timeout_s: float | None = None
    #: Seconds of silence on an engine stream before the engine is probed (failover if it is dead).
    engine_idle_timeout_s: float = 30.0
    max_engine_attempts: int = 4
    engine_stream_interval: bool = True
    max_receive_message_mb: int = 64
    max_send_message_mb: int = 256
    max_connection_age_s: float | None = 300.0
    max_connection_age_grace_s: float = 3600.0
    keepalive_time_s: float = 60.0
    peers: list[str] = field(default_factory=list)
    default_options: domain.GenerateOptions = field(default_factory=domain.GenerateOptions)
    max_images: int = 8

    def in_flight_limit(self) -> int:
        """server_concurrency x engine count (slime's semaphore size)."""
        engines = rollout_num_engines(
            self.rollout_num_gpus, self.rollout_num_gpus_per_engine, len(self.engines)
        )
        return max(1, self.server_concurrency * engines)

    def grpc_options(self) -> list[tuple[str, Any]]:
        """Channel arguments: message limits, keepalive, connection age for L4 rebalancing."""
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.max_receive_message_mb * 1024 * 1024),
            ("grpc.max_send_message_length", self.max_send_message_mb * 1024 * 1024),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        if self.max_connection_age_s:
            options += [
                ("grpc.max_connection_age_ms", int(self.max_connection_age_s * 1000)),
                ("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace_s * 1000)),
            ]
        return options


class RolloutServer:
    """One running replica."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port = 0
        self.health_port: int | None = None
        self._session: aiohttp.ClientSession | None = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._stopping = False
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.pool: EnginePool
        self.registry = InFlightRegistry()
        self.rollout: Rollout
        self.control: Control
        self.peers: PeerAborter | None = None

    async def start(self) -> None:
        """Create the HTTP session and engine pool, then serve."""
        cfg = self.config
        limit = cfg.in_flight_limit()
        # One session for the process; the connector must allow every admitted generation plus
        # control calls (aiohttp's default of 100 would silently cap concurrent engine streams).
        connector = aiohttp.TCPConnector(limit=limit + 64, limit_per_host=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(connector=connector)
        timeouts = EngineTimeouts(
            connect=cfg.engine_connect_timeout_s,
            sock_read=cfg.engine_read_timeout_s,
            idle=cfg.engine_idle_timeout_s,
        )
        self.pool = EnginePool(
            cfg.engines, self._session, timeouts=timeouts, health_interval_s=cfg.health_interval_s
        )
        admission = Admission(limit, cfg.max_queue, cfg.retry_after_s)
        self.rollout = Rollout(
            self.pool,
            admission,
            self.registry,
            RolloutConfig(
                max_engine_attempts=cfg.max_engine_attempts, engine_stream_interval=cfg.engine_stream_interval
            ),
        )
        if cfg.peers:
            self.peers = PeerAborter(cfg.peers)
        self.control = Control(
            self.pool, self.registry, self.rollout, peer_abort=self.peers.abort if self.peers else None
        )
        servicer = RolloutServicer(
            self.rollout, self.control, RenderService(self.pool, cfg.max_images), cfg.default_options
        )

        await self.pool.probe_all()
        self.pool.add_listener(self._on_engines_changed)
        self.pool.start()

        self._server = grpc.aio.server(options=cfg.grpc_options())
        pb_grpc.add_RolloutServiceServicer_to_server(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port = self._server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {cfg.host}:{cfg.port}")
        if self.peers is not None:
            self.peers.set_own_port(self.port)
        await self._server.start()
        if cfg.health_port is not None:
            self._health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            self.health_port = self._health_server.add_insecure_port(f"{cfg.host}:{cfg.health_port}")
            await self._health_server.start()
        log.info(
            "serving",
            port=self.port,
            health_port=self.health_port,
            engines=[e.url for e in self.pool.engines],
            in_flight_limit=limit,
        )

    def _on_engines_changed(self, any_usable: bool) -> None:
        if self._stopping:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if any_usable
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        task = asyncio.get_running_loop().create_task(self._health.set(SERVICE_NAME, status))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown: refuse new work, let generations finish, abort the rest into samples.

        1. health NOT_SERVING for good; the gRPC server stops accepting calls at once (GOAWAY, so
           clients and proxies send new calls to other replicas) while in-flight ones continue;
        2. wait up to `grace_s` for in-flight generations to finish;
        3. abort the remaining ones on their engines: their streams end with ABORTED samples
           carrying every token, delivered to the callers;
        4. close the HTTP session once the gRPC server has finished.
        """
        if self._stopping:
            return
        self._stopping = True
        grace = self.config.grace_s if grace_s is None else grace_s
        server_stopped: asyncio.Task[None] | None = None
        if self._server is not None:
            self.rollout.close()
            # The server's own grace outlasts ours: it must never cut a stream before its sample.
            server_stopped = asyncio.create_task(self._server.stop(grace + self.config.abort_grace_s + 5.0))
            # Let the shutdown begin (GOAWAY, listener closed) before readiness drops: a caller that
            # reacts to NOT_SERVING then gets UNAVAILABLE, never a call cancelled mid-shutdown.
            await asyncio.sleep(0)
        await self._health.enter_graceful_shutdown()
        if server_stopped is not None:
            if not await self.rollout.wait_idle(grace):
                remaining = [e.request_id for e in self.registry.all()]
                log.warning("shutdown_aborting", generations=len(remaining))
                for entry in self.registry.all():
                    entry.request_abort("server shutting down")
                if remaining:
                    with contextlib.suppress(Exception):
                        await self.control.abort_ids(remaining)
                await self.rollout.wait_idle(self.config.abort_grace_s)
            await server_stopped
        if self._health_server is not None:
            await self._health_server.stop(None)
        await self.pool.stop()
        if self.peers is not None:
            await self.peers.close()
        if self._session is not None:
            await self._session.close()
        log.info("stopped")

    async def wait_for_termination(self) -> None:
        """Block until the gRPC server has stopped."""
        if self._server is not None:
            await self._server.wait_for_termination()
