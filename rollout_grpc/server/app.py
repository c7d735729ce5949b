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
Core also refuses a random share of new calls once more than `grpc.server.max_pending_requests`
(1000 by default) wait to be picked up — a trainer's burst of 2048 calls lost ~10 % that way — so
that backlog is sized from admission (`ServerConfig.pending_calls_limit`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import socket
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server import config as sections
from rollout_grpc.server import side_ports
from rollout_grpc.server.config import (
    PENDING_HEADROOM,
    ServerConfig,
    buffer_caps,
    rollout_num_engines,
    trajectory_caps,
    worker_share,
)
from rollout_grpc.server.domain import bounds
from rollout_grpc.server.domain.identity import Role
from rollout_grpc.server.engines.capabilities import CapabilityChecker
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.engines.registry import adapter_factory
from rollout_grpc.server.envs.remote import RemoteEnvironment
from rollout_grpc.server.exposure import check_exposure
from rollout_grpc.server.facade.calls import TimedAdmission, log_call
from rollout_grpc.server.facade.door import CallBook, RolloutFacade
from rollout_grpc.server.front.grpc import decoding
from rollout_grpc.server.front.grpc.interceptor import RpcInterceptor
from rollout_grpc.server.front.grpc.peers import PeerAborter
from rollout_grpc.server.front.grpc.replica import ReplicaServicer
from rollout_grpc.server.front.grpc.service import RolloutServicer
from rollout_grpc.server.front.grpc.tls import peer_channel_credentials, server_credentials
from rollout_grpc.server.front.openai.server import OpenAIFrontDoor
from rollout_grpc.server.observe.httplog import engine_call_logging, engine_calls_logged
from rollout_grpc.server.observe.metrics import Metrics, MetricsEndpoint
from rollout_grpc.server.rewards import registry as rewards_registry
from rollout_grpc.server.rewards import remote_filter
from rollout_grpc.server.rewards.connections import PostConnections
from rollout_grpc.server.rewards.processes import RuleProcesses
from rollout_grpc.server.rollout.control import Control
from rollout_grpc.server.rollout.fanout import Fanout, Fanouts, StoreFanout
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.inflight import InFlightRegistry
from rollout_grpc.server.rollout.render import RenderService
from rollout_grpc.server.rollout.sessions import Sessions
from rollout_grpc.server.rollout.step.buffer import StepBuffers
from rollout_grpc.server.rollout.step.plugins import StepPlugins
from rollout_grpc.server.rollout.step.runner import StepRunner
from rollout_grpc.server.rollout.weights import WeightUpdates
from rollout_grpc.server.security.auth import AuthConfig, TokenStore
from rollout_grpc.server.security.limits import ControlRateLimiter
from rollout_grpc.server.security.refusals import AuthFailureLimiter, RefusalSampler
from rollout_grpc.server.security.tls import TlsConfig
from rollout_grpc.server.state.api import BufferStore
from rollout_grpc.server.state.choose import bus_for, store_for, trajectories_for
from rollout_grpc.server.state.trajectories import TrajectoryStore

log = structlog.get_logger(__name__)

#: The config's names, defined in `config.py`, stay importable from the wiring.
__all__ = [
    "PENDING_HEADROOM",
    "REPLICA_SERVICE_NAME",
    "SERVICE_NAME",
    "RolloutServer",
    "ServerConfig",
    "buffer_caps",
    "rollout_num_engines",
    "worker_share",
]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
REPLICA_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ReplicaService"].full_name


class RolloutServer:
    """One running replica."""

    #: What a worker process of `serve --workers N` replaces (workers/worker.py): the servicer
    #: (the worker count and the replica's load in GetServerInfo) and the start line (the
    #: supervisor logs `serving`); its siblings join the fanouts (`_fanouts`).
    servicer_class: type[RolloutServicer] = RolloutServicer
    serving_event: str = "serving"

    def __init__(self, config: ServerConfig, *, tracer_provider: Any = None) -> None:
        """`tracer_provider`: an OpenTelemetry TracerProvider (tests); else `otlp_endpoint` decides."""
        self.config = config
        self.port = 0
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self.metrics: Metrics
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._tracer_provider = tracer_provider
        self._session: aiohttp.ClientSession | None = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._stopping = False
        self._finishing = False
        self._stop_grace_s = config.grace_s
        self._server_stopped: asyncio.Task[None] | None = None
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.pool: EnginePool
        self.registry = InFlightRegistry(config.per_caller_limit(), config.retry_after_s)
        self.auth = self._auth_config(config.section(sections.SecurityConfig))
        self.rollout: Rollout
        self.control: Control
        self.weights: WeightUpdates
        self.facade: RolloutFacade
        #: RolloutStep runs (None until the servicer is built).
        self.steps: StepRunner | None = None
        #: The child processes of rule rewards (started on the first MATH/EXACT_MATCH reward).
        self.rule_processes: RuleProcesses | None = None
        #: The keep-alive pool of every step's reward, filter and environment POSTs.
        self.post_connections = PostConnections()
        self.peers: PeerAborter | None = None
        self.store_fanout: StoreFanout | None = None
        self.front_door: OpenAIFrontDoor | None = None
        self.openai_port: int | None = None
        #: Fleet state (step buffers): checked at start (`start` exits when it does not answer).
        self.state = self._state_store()
        #: Agent sessions, in the same store (any replica or worker sharing it serves them).
        self.trajectories = Sessions(self._trajectory_store())

    def _trajectory_store(self) -> TrajectoryStore:
        """The sessions' store, where the step buffers are (a worker reaches its supervisor's)."""
        return trajectories_for(self.state, trajectory_caps(self.config))

    def _state_store(self) -> BufferStore:
        """The store `--state-store` names (a worker of --workers N reaches its supervisor's)."""
        store = self.config.section(sections.StateStoreConfig)
        return store_for(
            store.state_store,
            self.config.section(sections.StepConfig).buffer_caps(),
            password_file=store.state_store_password_file,
            ca_file=store.state_store_ca_file,
        )

    def lease_holder(self) -> str:
        """How this process names itself in the fleet's weight-update lease (a refused update's
        message shows it): the host, the pid and the replica's instance token."""
        return f"replica {socket.gethostname()} pid {os.getpid()} instance {self.rollout.call_ids.instance}"

    @staticmethod
    def _auth_config(security: sections.SecurityConfig) -> AuthConfig:
        tokens = TokenStore(security.auth_tokens_file) if security.auth_tokens_file else None
        cert_roles = {name: Role(role) for name, role in security.mtls_roles.items()}
        if cert_roles and not security.tls_client_ca_file:
            raise ValueError(
                "--mtls-role needs --tls-client-ca (client certificates are only verified under mTLS)"
            )
        return AuthConfig(tokens=tokens, cert_roles=cert_roles, reflection_open=security.reflection_open)

    def reload_credentials(self) -> None:
        """Re-read the tokens file now (SIGHUP); certificates reload by themselves at handshakes."""
        if self.auth.tokens is not None:
            self.auth.tokens.reload()

    def _check_exposure(self, tls: TlsConfig | None) -> None:
        """Refuse to serve a network address without authentication, or tokens without TLS,
        unless the network is declared trusted (exposure.py); warn then."""
        cfg = self.config
        check_exposure(
            cfg.host,
            auth=self.auth.enabled,
            tokens=self.auth.tokens is not None,
            tls=tls is not None,
            trusted=cfg.insecure_trusted_network,
        )

    def _peer_aborter(self, tls: TlsConfig | None) -> PeerAborter:
        security = self.config.section(sections.SecurityConfig)
        metadata: list[tuple[str, str]] = []
        if security.peer_token_file:
            token = Path(security.peer_token_file).read_text().strip()
            metadata.append(("authorization", f"Bearer {token}"))
        credentials = peer_channel_credentials(tls, security.peer_ca_file) if tls is not None else None
        return PeerAborter(
            self.config.peers,
            timeout_s=self.config.control_deadline_s,
            credentials=credentials,
            metadata=metadata,
            tls_server_name=security.peer_tls_name,
        )

    def _fanouts(self, tls: TlsConfig | None) -> list[Fanout]:
        """Who else holds generations (rollout/fanout.py): every process on the shared store's bus
        (`--state-store redis://...`, the recommended path), else the `--peer` replicas."""
        cfg = self.config
        bus = bus_for(self.state)
        if bus is not None:
            if cfg.peers:  # they would be asked twice (and counted twice): the store reaches them
                log.warning(
                    "peers_not_used", peers=cfg.peers, reason=f"aborts reach every replica via {bus.name}"
                )
            self.store_fanout = StoreFanout(bus, cfg.control_deadline_s)
            return [self.store_fanout]
        if cfg.peers:
            self.peers = self._peer_aborter(tls)
            return [self.peers]
        return []

    async def start(self) -> None:
        """Open the engine session, build the domain and the gRPC server, then serve."""
        cfg = self.config
        limit = cfg.in_flight_limit()
        tls = cfg.tls()
        self._check_exposure(tls)  # before anything listens
        await self.state.ping()  # StoreUnavailable: serve exits with one line naming the store
        session, interceptors = self._open_engine_session()
        servicer = self._build_domain(session, limit, tls)
        if self.store_fanout is not None:  # StoreUnavailable: serve exits naming the store
            await self.store_fanout.start(self.control.abort_here)
        await self._start_engine_pool()
        self._server = self._build_grpc_server(servicer, interceptors, tls)
        await self._server.start()
        await self._start_side_ports(tls)
        log.info(
            self.serving_event,
            port=self.port,
            health_port=self.health_port,
            openai_port=self.openai_port,
            metrics_port=self.metrics_port,
            simulated_engines=cfg.simulated_engines or None,
            engines=[e.url for e in self.pool.engines],
            in_flight_limit=limit,
            tls="mutual" if tls is not None and tls.mutual else ("on" if tls is not None else "off"),
            auth="on" if self.auth.enabled else "off",
            # In every engine request id of this replica (rollout/call_ids.py): grep engine logs.
            engine_id_instance=self.rollout.call_ids.instance,
        )

    def _open_engine_session(self) -> tuple[aiohttp.ClientSession, list[grpc.aio.ServerInterceptor]]:
        """Create the process's one HTTP session to the engines (traced if tracing is on).

        Returns it with the gRPC interceptors that go first: the tracing one, when there is a provider.
        """
        cfg = self.config
        # One session for the process. Admission is the one limit on engine streams: the HTTP
        # connector has none of its own (aiohttp's default of 100, or any fixed number, would
        # silently cap concurrent engine streams below it, and not follow an engines-file reload).
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        if self._tracer_provider is None and cfg.otlp_endpoint:
            try:
                from rollout_grpc.server.observe.tracing import otlp_provider
            except ImportError as exc:
                raise RuntimeError(
                    "--otlp-endpoint needs the tracing extra: pip install 'rollout-grpc[tracing]'"
                ) from exc
            self._tracer_provider = otlp_provider(cfg.otlp_endpoint)
        # The debug log's trace config only when debug lines are kept: aiohttp builds trace
        # parameter objects for every signal of every request once any trace config is set.
        trace_configs = [engine_call_logging()] if engine_calls_logged() else []
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self._tracer_provider is not None:
            from rollout_grpc.server.observe.tracing import TracingInterceptor, engine_tracing

            trace_configs.append(engine_tracing(self._tracer_provider))
            interceptors.append(TracingInterceptor(self._tracer_provider))
        self._session = aiohttp.ClientSession(connector=connector, trace_configs=trace_configs)
        return self._session, interceptors

    def _build_domain(
        self, session: aiohttp.ClientSession, limit: int, tls: TlsConfig | None
    ) -> RolloutServicer:
        """The engine pool, admission, metrics, Rollout, Control and the servicer over them."""
        cfg = self.config
        engines = cfg.section(sections.EnginesConfig)
        self.pool = EnginePool(
            engines.engines,
            adapter_factory(
                session,
                engines.engine_timeouts(),
                lambda: self.config.engine_kinds,  # replaced on reload, read when an engine joins
                engines.kind_options(),
            ),
            health_interval_s=engines.health_interval_s,
            breaker_cooldown_s=engines.breaker_cooldown_s,
            capability_check=CapabilityChecker(self.config.raw_logprobs),
        )
        admission = self._admission(limit)
        observe = cfg.section(sections.ObserveConfig)
        self.metrics = Metrics(self.pool, admission, engine_urls=observe.metrics_engine_urls)
        #: Every call's record, of either door, goes to these (log line, metrics; tests add theirs).
        self.calls = CallBook([log_call, self.metrics.observe])
        self.rollout = Rollout(
            self.pool,
            admission,
            self.registry,
            cfg.rollout_config(),
        )
        self.control = Control(
            self.pool,
            self.registry,
            self.rollout,
            deadline_s=cfg.control_deadline_s,
            fanout=Fanouts(self._fanouts(tls)),
            epochs=self.state,
        )
        bound = cfg.section(sections.BoundsConfig)
        renderer = RenderService(
            self.pool, bound.max_images, max_pixels=bound.max_image_pixels, max_bytes=bound.max_image_bytes
        )
        #: RolloutStep: reward models are built per step from the registry of reward kinds.
        step = cfg.section(sections.StepConfig)
        self.rule_processes = rewards_registry.rule_processes(step.rule_process_limits())
        steps = self.steps = StepRunner(
            self.rollout,
            self.control.abort_ids,
            functools.partial(
                rewards_registry.build, rules=self.rule_processes, connections=self.post_connections
            ),
            reward_urls=step.reward_urls,
            plugins=StepPlugins.load(step.step_plugins),
            remote_filters=functools.partial(remote_filter.build, connections=self.post_connections),
            environments=functools.partial(RemoteEnvironment, connections=self.post_connections),
            env_urls=step.env_urls,
            buffers=StepBuffers(self.state),
        )
        weights = cfg.section(sections.WeightsConfig)
        self.weights = WeightUpdates(
            self.pool,
            self.control,
            path_prefixes=weights.weights_path_prefixes,
            load_timeout_s=weights.weights_load_timeout_s,
            deadline_s=cfg.control_deadline_s,
            store=self.state,
            holder=self.lease_holder(),
            lease_ttl_s=weights.weights_lease_ttl_s,
        )
        self.facade = RolloutFacade(
            self.rollout,
            self.control,
            renderer,
            trajectories=self.trajectories,
            calls=self.calls,
            steps=steps,
            weights=self.weights,
        )
        return self.servicer_class(self.facade, cfg.default_options, simulated_engines=cfg.simulated_engines)

    def _admission(self, limit: int) -> TimedAdmission:
        """Admission with `limit` generations in flight (a worker shares it with its siblings)."""
        return TimedAdmission(limit, self.config.max_queue, self.config.retry_after_s)

    async def _start_engine_pool(self) -> None:
        """Classify every engine once (capability check), then start health probing."""
        await self.pool.probe_all()
        self.pool.add_listener(self._on_engines_changed)
        self.pool.start()

    def _build_grpc_server(
        self,
        servicer: RolloutServicer,
        interceptors: list[grpc.aio.ServerInterceptor],
        tls: TlsConfig | None,
    ) -> grpc.aio.Server:
        """The main gRPC server with its interceptor chain and services, bound to its port."""
        cfg = self.config
        sec = cfg.section(sections.SecurityConfig)
        # The one per-call wrapper: record, auth, bounds, status mapping (refusals at the door are
        # recorded and counted too); tracing (when on) inside it.
        # The per-call wrapper goes first: it reads a request off the wire only once the caller
        # is authenticated (front/grpc/wire.py), so tracing (inside it) spans admitted calls only.
        chain = [
            RpcInterceptor(
                self.calls,
                self.auth,
                cfg.request_limits(),
                ControlRateLimiter(cfg.control_rate_per_s, cfg.control_burst),
                engine_urls=lambda: [e.url for e in self.pool.engines],
                auth_failures=AuthFailureLimiter(sec.auth_failure_rate_per_s, sec.auth_failure_burst),
                refusal_audit=RefusalSampler(sec.refusal_audit_rate_per_s, sec.refusal_audit_burst),
            ),
            *interceptors,
        ]
        server = grpc.aio.server(options=cfg.grpc_options(), interceptors=chain)
        decoding.add_rollout_service(servicer, server)
        pb_grpc.add_ReplicaServiceServicer_to_server(ReplicaServicer(self.facade), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if sec.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, REPLICA_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                server,
            )
        self.port = side_ports.bind(
            server, cfg.host, cfg.port, server_credentials(tls) if tls is not None else None, "gRPC, --port"
        )
        if self.peers is not None:
            self.peers.set_own_port(self.port)
        return server

    async def _start_side_ports(self, tls: TlsConfig | None) -> None:
        """The optional health, OpenAI front-door and metrics ports, each when configured."""
        cfg = self.config
        if cfg.health_port is not None:
            self._health_server, self.health_port = await side_ports.start_health_server(
                self._health, cfg, tls
            )
        door = cfg.section(sections.OpenAIConfig)
        if door.openai_port is not None:
            self.front_door, self.openai_port = await side_ports.start_front_door(
                self.facade, cfg, self.auth, tls, door.openai_port
            )
        observe = cfg.section(sections.ObserveConfig)
        if observe.metrics_port is not None:
            self._metrics_endpoint, self.metrics_port = await side_ports.start_metrics(
                self.metrics, cfg.host, observe.metrics_port
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

    def reload_engines(self, urls: list[str], kinds: dict[str, str] | None = None) -> None:
        """Make the engine list `urls` (SIGHUP): engines join or drain, and the admission limit
        follows the new engine count (the HTTP connector has no limit of its own to resize).

        `kinds` (URL -> kind, vLLM when absent) replaces the config's table before the pool changes
        (a new config: the one the replica started with, or a caller holds, is never edited), since
        the adapter factory reads the current table when an engine joins. An engine already in the
        pool keeps its adapter."""
        self.config = dataclasses.replace(self.config, engines=list(urls), engine_kinds=dict(kinds or {}))
        self.pool.replace(urls)
        limit = self.config.in_flight_limit()
        self.rollout.admission.resize(limit)
        log.info("engines_reloaded", engines=list(urls), in_flight_limit=limit)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown within `ServerConfig.shutdown_bound_s()`, hung engines included.

        1. the gRPC server stops accepting calls at once (GOAWAY, so clients and proxies send new
           calls to other replicas) while in-flight ones continue (`stop_accepting`);
        2. health NOT_SERVING for good (`finish_stop` from here on);
        3. wait up to `grace_s` for in-flight generations to finish;
        4. abort the remaining ones (locally and on their engines, one control deadline for the
           engines): their streams end with ABORTED samples carrying every token;
        5. give them `abort_grace_s` to deliver those samples; the gRPC server's own grace ends
           there, so nothing outlives the bound;
        6. stop the health server and close the HTTP session (bounded too).

        A `serve --workers N` worker runs the two halves as separate phases (its supervisor starts
        the second once every worker finished the first, docs/workers.md); a second call returns
        at once, as before.
        """
        await self.stop_accepting(grace_s)  # both halves are idempotent
        await self.finish_stop()

    async def stop_accepting(self, grace_s: float | None = None, phase_gap_s: float = 0.0) -> None:
        """Shutdown step 1: refuse new generations, GOAWAY, close the listener; idempotent.

        `phase_gap_s`: the longest `finish_stop` may come after this call (a worker's supervisor
        waits that long at most for the siblings), added to the gRPC server's own grace so that
        the in-flight streams still get the whole grace and abort grace of step 3-5."""
        if self._stopping:
            return
        self._stopping = True
        self._stop_grace_s = self.config.grace_s if grace_s is None else grace_s
        if self._server is not None:
            self.rollout.close()
            cfg = self.config
            server_grace = self._stop_grace_s + cfg.control_deadline_s + cfg.abort_grace_s + phase_gap_s
            self._server_stopped = asyncio.create_task(self._server.stop(server_grace))
            # Let the shutdown begin (GOAWAY, listener closed) before this returns: the task's first
            # step runs before this coroutine resumes (the loop runs ready callbacks in order), so
            # a caller that reacts to the later NOT_SERVING gets UNAVAILABLE, never a call
            # cancelled mid-shutdown.
            await asyncio.sleep(0)

    async def finish_stop(self) -> None:
        """Shutdown steps 2-6 (after `stop_accepting`); idempotent."""
        if self._finishing:
            return
        self._finishing = True
        await self.stop_accepting()
        grace = self._stop_grace_s
        server_stopped = self._server_stopped
        await self._health.enter_graceful_shutdown()
        if server_stopped is not None:
            if not await self.rollout.wait_idle(grace):
                remaining = self.registry.all()
                log.warning("shutdown_aborting", generations=len(remaining))
                for entry in remaining:
                    entry.request_abort("server shutting down")
                if remaining:
                    try:
                        # This replica's own calls only: never forwarded, never another owner's.
                        await self.control.abort_entries(remaining)
                    except Exception:  # the local aborts are set; engines are best effort
                        log.exception("shutdown_abort_failed")
                await self.rollout.wait_idle(self.config.abort_grace_s)
            await server_stopped
        try:
            async with asyncio.timeout(bounds.SHUTDOWN_CLOSE_S):
                if self.steps is not None:  # RolloutStep aborts and buffer drains, before the session closes
                    await self.steps.drained()
                await self._close()
        except TimeoutError:
            log.warning("shutdown_close_timeout", seconds=bounds.SHUTDOWN_CLOSE_S)
        log.info("stopped")

    async def _close(self) -> None:
        if self.front_door is not None:
            await self.front_door.stop()
        if self._health_server is not None:
            await self._health_server.stop(None)
        if self._metrics_endpoint is not None:
            await self._metrics_endpoint.stop()
        if self._tracer_provider is not None and hasattr(self._tracer_provider, "force_flush"):
            self._tracer_provider.force_flush()
        await self.pool.stop()
        await self.weights.close()
        await self.control.close()
        if self.rule_processes is not None:
            await self.rule_processes.close()
        await self.post_connections.close()
        if self.peers is not None:
            await self.peers.close()
        if self.store_fanout is not None:
            await self.store_fanout.close()
        await self.state.close()
        await self.trajectories.store.close()
        if self._session is not None:
            await self._session.close()
