"""Assembles and runs one service replica: gRPC server, health, reflection, engines, shutdown.

Health (`grpc.health.v1`) is served on the main port and on a separate port of its own, so probes
still answer when the rollout RPCs are saturated (no `maximum_concurrent_rpcs` is used: admission
control is per generation, see `admission.py`). The service name's status follows engine
availability: SERVING while at least one engine is usable, NOT_SERVING otherwise and during
shutdown; "" (liveness) stays SERVING while the process runs.

Every call reaches admission: grpc.aio picks calls up from gRPC core one per event-loop turn, and
core cancels calls left unpicked longer than `grpc.server_max_unrequested_time_in_server` (30 s by
default) — CANCELLED, unseen, without a queue slot or a retry hint, which a busy loop under
thousands of streams reaches. `maximum_concurrent_rpcs` would make it worse (calls beyond it stay
unpicked), so it is not used, and the hold is raised (`ServerConfig.max_unrequested_time_s`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server import bounds, decoding, domain
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
    #: After the grace: time the aborted generations get to end as samples (bounds.py).
    abort_grace_s: float = bounds.SHUTDOWN_ABORT_DRAIN_S
    #: One overall deadline for Abort(all), Pause (ABORT, KEEP) and Resume fan-outs (bounds.py).
    control_deadline_s: float = bounds.CONTROL_DEADLINE_S
    health_interval_s: float = 2.0
    breaker_cooldown_s: float = 5.0
    engine_connect_timeout_s: float = 5.0
    engine_read_timeout_s: float | None = None
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
    #: Largest image accepted by Render, in pixels (width x height, read from the header before
    #: decoding: decompression bombs are refused unopened) and in encoded bytes.
    max_image_pixels: int = 64_000_000
    max_image_bytes: int = 32 * 1024 * 1024
    #: How long gRPC core may hold a call the application has not yet picked up before it cancels
    #: it unseen (`grpc.server_max_unrequested_time_in_server`, 30 s by default). The aio server
    #: picks calls up one per event-loop turn, so a burst of thousands of streams on a busy loop
    #: can wait longer than that; every call must reach admission (run, queue or
    #: RESOURCE_EXHAUSTED with a retry hint) instead, so the hold is as long as a day (the
    #: caller's own deadline still applies).
    max_unrequested_time_s: float = 86_400.0

    def shutdown_bound_s(self, grace_s: float | None = None) -> float:
        """The longest this replica takes from SIGTERM to exit (bounds.py), hung engines included."""
        return bounds.shutdown_bound_s(
            self.grace_s if grace_s is None else grace_s, self.control_deadline_s, self.abort_grace_s
        )

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
            ("grpc.server_max_unrequested_time_in_server", int(self.max_unrequested_time_s)),
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
        # One session for the process. Admission is the one limit on engine streams: the HTTP
        # connector has none of its own (aiohttp's default of 100, or any fixed number, would
        # silently cap concurrent engine streams below it, and not follow an engines-file reload).
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(connector=connector)
        timeouts = EngineTimeouts(connect=cfg.engine_connect_timeout_s, sock_read=cfg.engine_read_timeout_s)
        self.pool = EnginePool(
            cfg.engines,
            self._session,
            timeouts=timeouts,
            health_interval_s=cfg.health_interval_s,
            breaker_cooldown_s=cfg.breaker_cooldown_s,
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
            self.peers = PeerAborter(cfg.peers, timeout_s=cfg.control_deadline_s)
        self.control = Control(
            self.pool,
            self.registry,
            self.rollout,
            deadline_s=cfg.control_deadline_s,
            peer_abort=self.peers.abort if self.peers else None,
        )
        renderer = RenderService(
            self.pool, cfg.max_images, max_pixels=cfg.max_image_pixels, max_bytes=cfg.max_image_bytes
        )
        servicer = RolloutServicer(self.rollout, self.control, renderer, cfg.default_options)

        await self.pool.probe_all()
        self.pool.add_listener(self._on_engines_changed)
        self.pool.start()

        self._server = grpc.aio.server(options=cfg.grpc_options())
        decoding.add_rollout_service(servicer, self._server)
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

    def reload_engines(self, urls: list[str]) -> None:
        """Make the engine list `urls` (SIGHUP): engines join or drain, and the admission limit
        follows the new engine count (the HTTP connector has no limit of its own to resize)."""
        self.config.engines = list(urls)
        self.pool.replace(urls)
        limit = self.config.in_flight_limit()
        self.rollout.admission.resize(limit)
        log.info("engines_reloaded", engines=list(urls), in_flight_limit=limit)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown within `ServerConfig.shutdown_bound_s()`, hung engines included.

        1. health NOT_SERVING for good; the gRPC server stops accepting calls at once (GOAWAY, so
           clients and proxies send new calls to other replicas) while in-flight ones continue;
        2. wait up to `grace_s` for in-flight generations to finish;
        3. abort the remaining ones (locally and on their engines, one control deadline for the
           engines): their streams end with ABORTED samples carrying every token;
        4. give them `abort_grace_s` to deliver those samples; the gRPC server's own grace ends
           there, so nothing outlives the bound;
        5. stop the health server and close the HTTP session (bounded too).
        """
        if self._stopping:
            return
        self._stopping = True
        grace = self.config.grace_s if grace_s is None else grace_s
        server_stopped: asyncio.Task[None] | None = None
        if self._server is not None:
            self.rollout.close()
            server_grace = grace + self.config.control_deadline_s + self.config.abort_grace_s
            server_stopped = asyncio.create_task(self._server.stop(server_grace))
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
                    try:
                        await self.control.abort_ids(remaining)
                    except Exception:  # the local aborts are set; engines are best effort
                        log.exception("shutdown_abort_failed")
                await self.rollout.wait_idle(self.config.abort_grace_s)
            await server_stopped
        try:
            async with asyncio.timeout(bounds.SHUTDOWN_CLOSE_S):
                await self._close()
        except TimeoutError:
            log.warning("shutdown_close_timeout", seconds=bounds.SHUTDOWN_CLOSE_S)
        log.info("stopped")

    async def _close(self) -> None:
        if self._health_server is not None:
            await self._health_server.stop(None)
        await self.pool.stop()
        await self.control.close()
        if self.peers is not None:
            await self.peers.close()
        if self._session is not None:
            await self._session.close()
