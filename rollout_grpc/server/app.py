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
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server import ports
from rollout_grpc.server.domain import bounds
from rollout_grpc.server.domain import model as domain
from rollout_grpc.server.domain.identity import Role
from rollout_grpc.server.domain.trajectory import TrajectoryStore
from rollout_grpc.server.engines.api import EngineTimeouts
from rollout_grpc.server.engines.capabilities import CapabilityChecker
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.engines.registry import KindOptions, adapter_factory
from rollout_grpc.server.exposure import check_exposure
from rollout_grpc.server.facade.calls import TimedAdmission, log_call
from rollout_grpc.server.facade.door import CallBook, RolloutFacade
from rollout_grpc.server.front.grpc import decoding
from rollout_grpc.server.front.grpc.interceptor import RpcInterceptor
from rollout_grpc.server.front.grpc.peers import PeerAborter
from rollout_grpc.server.front.grpc.replica import ReplicaServicer
from rollout_grpc.server.front.grpc.service import RolloutServicer
from rollout_grpc.server.front.grpc.tls import peer_channel_credentials, server_credentials
from rollout_grpc.server.front.openai.server import FrontDoorConfig, OpenAIFrontDoor
from rollout_grpc.server.observe.httplog import engine_call_logging, engine_calls_logged
from rollout_grpc.server.observe.metrics import Metrics, MetricsEndpoint
from rollout_grpc.server.ports import NO_REUSEPORT
from rollout_grpc.server.rewards import registry as rewards_registry
from rollout_grpc.server.rewards.processes import ProcessLimits, RuleProcesses
from rollout_grpc.server.rollout.control import Control
from rollout_grpc.server.rollout.generation import Rollout, RolloutConfig
from rollout_grpc.server.rollout.inflight import InFlightRegistry
from rollout_grpc.server.rollout.render import RenderService
from rollout_grpc.server.rollout.step.buffer import StepBuffers
from rollout_grpc.server.rollout.step.runner import StepRunner
from rollout_grpc.server.rollout.weights import DEFAULT_LOAD_TIMEOUT_S, WeightUpdates
from rollout_grpc.server.security.auth import AuthConfig, TokenStore
from rollout_grpc.server.security.limits import ControlRateLimiter, RequestLimits
from rollout_grpc.server.security.refusals import AuthFailureLimiter, RefusalSampler
from rollout_grpc.server.security.tls import TlsConfig
from rollout_grpc.server.state.api import BufferCaps, BufferStore
from rollout_grpc.server.state.choose import store_for

log = structlog.get_logger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
REPLICA_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ReplicaService"].full_name
#: Pending calls gRPC core holds beyond admission's running + queued generations: the unary and
#: control calls of a burst (GetServerInfo, Abort, health). gRPC's own default soft limit.
PENDING_HEADROOM = 1000


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
    #: The kind of each engine URL that is not vLLM ("sglang"), as the settings read it from a
    #: `sglang+http://...` URL; the registry picks each engine's adapter from it.
    engine_kinds: dict[str, str] = field(default_factory=dict)
    #: The MoE model's `num_experts_per_tok`, which SGLang's shape-less R3 bytes need (None: R3 is
    #: off on SGLang engines, with a warning in their capabilities).
    sglang_experts_topk: int | None = None
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
    #: Seconds of silence on an engine stream before the engine is probed (failover if it is dead).
    engine_idle_timeout_s: float = 30.0
    max_engine_attempts: int = 4
    #: Most seconds before a caller's deadline that a generation ends with its sample (ABORTED,
    #: every token kept); 10 % of the caller's time when that is less (bounds.py).
    deadline_margin_s: float = bounds.DEADLINE_MARGIN_S
    #: Most seconds before that the engine call is aborted upstream so that the engine's final
    #: chunk (every token it made) arrives in time; 10 % of the caller's time, at least 50 ms,
    #: when that is less (bounds.py, rollout/deadline.py).
    deadline_abort_lead_s: float = bounds.DEADLINE_ABORT_LEAD_S
    engine_stream_interval: bool = True
    max_receive_message_mb: int = 64
    max_send_message_mb: int = 256
    max_connection_age_s: float | None = 300.0
    max_connection_age_grace_s: float = 3600.0
    keepalive_time_s: float = 60.0
    peers: list[str] = field(default_factory=list)
    #: URL prefixes a RolloutStep's REMOTE reward may POST to (empty: any). A reward URL makes the
    #: replica send requests where the caller says: pin it to the reward servers you run.
    reward_urls: list[str] = field(default_factory=list)
    #: Rule rewards (MATH, EXACT_MATCH) run in this many child processes per replica process, each
    #: call killed past the time limit, each child capped in address space (rewards/processes.py).
    rule_reward_processes: int = 2
    rule_reward_timeout_s: float = 10.0
    rule_reward_memory_mb: int = 1024
    #: RolloutStep buffers (leftovers=BUFFER, abandoned steps), estimated MiB per caller and in all.
    step_buffer_mb_per_caller: int = 256
    step_buffer_mb: int = 512
    #: Seconds a caller's buffer lives after its last write (expired groups are reported lost).
    step_buffer_ttl_s: float = 3600.0
    #: Where fleet state lives (server/state): "" this process (the supervisor's with --workers),
    #: or redis://host:port/db, rediss://... shared by every replica; the password from a file.
    state_store: str = ""
    state_store_password_file: str | None = None
    state_store_ca_file: str | None = None
    #: Directories UpdateWeights may name checkpoints under (`--weights-path-prefix`; empty: off).
    weights_path_prefixes: list[str] = field(default_factory=list)
    #: Seconds one engine may take to load a checkpoint (`--weights-load-timeout`).
    weights_load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    default_options: domain.GenerateOptions = field(default_factory=domain.GenerateOptions)
    max_images: int = 8
    # --- security (docs/security.md) ---
    #: PEM server certificate chain and key: TLS on the gRPC port (and the health port).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    #: PEM CA of client certificates: mTLS, clients without a certificate it signed are refused.
    tls_client_ca_file: str | None = None
    #: Keep the health port plaintext under TLS (Kubernetes gRPC probes cannot speak TLS).
    health_plaintext: bool = False
    #: Bearer tokens file (`identity role token` lines; a Secret mount): authentication on.
    auth_tokens_file: str | None = None
    #: mTLS client certificate name (SAN or CN) -> role ("trainer", "admin", "peer").
    mtls_roles: dict[str, str] = field(default_factory=dict)
    #: Serve gRPC server reflection; with authentication on it needs a credential unless open.
    reflection: bool = True
    reflection_open: bool = False
    #: Every host that can reach `host` is trusted: serve a network address without authentication
    #: or send tokens without TLS (refused otherwise; exposure.py). `--insecure-trusted-network`.
    insecure_trusted_network: bool = False
    #: Token this replica presents to its peers (a `peer` or `admin` line of their tokens file).
    peer_token_file: str | None = None
    #: CA that verifies the peers' certificates (default: the client CA, else the system roots).
    peer_ca_file: str | None = None
    #: Name the peers' certificates are checked against (peers are dialed by IP when resolved).
    peer_tls_name: str | None = None
    #: Request bounds (limits.RequestLimits) and per-caller limits.
    max_abort_ids: int = 1024
    max_metadata_bytes: int = 1 << 20
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_chat_template_kwargs_bytes: int = 64 << 10
    #: Characters of prompt text of one chat render (front-door turn, Render RPC), before the engine.
    max_prompt_chars: int = 4 << 20
    #: Serialized request of every RPC but Generate, RolloutStep and Render, checked before decoding.
    max_control_request_bytes: int = 1 << 20
    #: Failed authentications per peer address: burst (0 = unlimited), then this rate; past it
    #: RESOURCE_EXHAUSTED (a valid credential still gets in). security/refusals.py.
    auth_failure_rate_per_s: float = 1.0
    auth_failure_burst: int = 20
    #: Audit lines of refused control RPCs: burst (0 = every one), then this rate; the rest counted.
    refusal_audit_rate_per_s: float = 1.0
    refusal_audit_burst: int = 20
    #: Generations (running + queued) one authenticated caller may hold; 0 = half of the in-flight
    #: limit plus the queue, so that one trainer cannot starve the others.
    max_in_flight_per_caller: int = 0
    #: Control RPCs (Abort, Pause, Resume) per caller: sustained rate (0 = unlimited) and burst.
    control_rate_per_s: float = 10.0
    control_burst: int = 50

    #: Port of the OpenAI-compatible front door (0 = pick a free one, None = off); docs/agentic.md.
    openai_port: int | None = None
    openai: FrontDoorConfig = field(default_factory=FrontDoorConfig)
    #: Port of the Prometheus /metrics endpoint (0 = any free port, None = no endpoint).
    metrics_port: int | None = None
    #: Label engine series with their URLs (default: the `engine-<8 hex>` labels non-admins see;
    #: the endpoint has no authentication).
    metrics_engine_urls: bool = False
    #: OTLP/gRPC collector for OpenTelemetry traces ("" = tracing off; needs the `tracing` extra).
    otlp_endpoint: str = ""
    #: Engines whose logprobs mode is vLLM's default `raw_logprobs`: "refuse" (not routed to) or
    #: "warn" (routed to, with a warning in the log and in GetServerInfo).
    raw_logprobs: str = "warn"
    #: The engines are simulated (`--sim`): said loudly in the log and in GetServerInfo.
    simulated_engines: bool = False
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
    #: Calls gRPC core may hold before the application picks them up (its pending-call backlog
    #: protector, `grpc.server.max_pending_requests`, soft 1000 / hard 3000 by default: above the
    #: soft limit a growing random share of new calls is refused unseen, CANCELLED). 0 = sized from
    #: admission: the in-flight limit + the queue + `PENDING_HEADROOM` for the unary and control
    #: calls, so that every call of a burst reaches admission (run, queue or RESOURCE_EXHAUSTED
    #: with a retry hint); the hard limit is twice that.
    max_pending_calls: int = 0
    # --- worker processes (`serve --workers N`; set per worker by the supervisor, docs/workers.md) ---
    #: Bind the gRPC port with SO_REUSEPORT: only a worker, whose supervisor reserved the port
    #: (workers/reservation.py), ever sets it; a replica of its own keeps a busy port an error.
    reuse_port: bool = False
    #: Replacements of dead workers the supervisor makes within `worker_restart_window_s` before it
    #: stops the replica (exit 1); each after an exponential back-off (workers/supervisor.py).
    worker_restarts: int = 5
    worker_restart_window_s: float = 60.0

    def tls(self) -> TlsConfig | None:
        """The TLS settings, or None for plaintext; a key without a certificate is a config error."""
        if not self.tls_cert_file and not self.tls_key_file:
            if self.tls_client_ca_file:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not (self.tls_cert_file and self.tls_key_file):
            raise ValueError("--tls-cert and --tls-key go together")
        return TlsConfig(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    def request_limits(self) -> RequestLimits:
        """The per-request caps."""
        return RequestLimits(
            max_abort_ids=self.max_abort_ids,
            max_metadata_bytes=self.max_metadata_bytes,
            max_stop_strings=self.max_stop_strings,
            max_stop_string_chars=self.max_stop_string_chars,
            max_chat_template_kwargs_bytes=self.max_chat_template_kwargs_bytes,
            max_control_request_bytes=self.max_control_request_bytes,
            max_prompt_chars=self.max_prompt_chars,
        )

    def per_caller_limit(self) -> int:
        """Generations one authenticated caller may hold (running + queued)."""
        if self.max_in_flight_per_caller > 0:
            return self.max_in_flight_per_caller
        return max(1, (self.in_flight_limit() + self.max_queue) // 2)

    def shutdown_bound_s(self, grace_s: float | None = None, workers: int = 1) -> float:
        """The longest this replica takes from SIGTERM to exit (bounds.py), hung engines included;
        `workers`: the processes of `serve --workers N` (1: one process, or one worker's own stop)."""
        return bounds.shutdown_bound_s(
            self.grace_s if grace_s is None else grace_s,
            self.control_deadline_s,
            self.abort_grace_s,
            workers,
        )

    def in_flight_limit(self) -> int:
        """server_concurrency x engine count (slime's semaphore size)."""
        engines = rollout_num_engines(
            self.rollout_num_gpus, self.rollout_num_gpus_per_engine, len(self.engines)
        )
        return max(1, self.server_concurrency * engines)

    def pending_calls_limit(self) -> int:
        """Calls gRPC core holds before the replica picks them up, before it refuses any (soft)."""
        if self.max_pending_calls > 0:
            return self.max_pending_calls
        return self.in_flight_limit() + self.max_queue + PENDING_HEADROOM

    def grpc_options(self) -> list[tuple[str, Any]]:
        """Channel arguments: message limits, keepalive, connection age for L4 rebalancing, and the
        holds of calls not picked up yet (long enough, and enough of them, for every call to reach
        admission)."""
        pending = self.pending_calls_limit()
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.max_receive_message_mb * 1024 * 1024),
            ("grpc.max_send_message_length", self.max_send_message_mb * 1024 * 1024),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.server_max_unrequested_time_in_server", int(self.max_unrequested_time_s)),
            ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
            # A busy port is an error, never a port silently shared with another process; a
            # worker shares the port its supervisor reserved with its siblings only.
            ("grpc.so_reuseport", 1) if self.reuse_port else NO_REUSEPORT,
        ]
        if self.max_connection_age_s:
            options += [
                ("grpc.max_connection_age_ms", int(self.max_connection_age_s * 1000)),
                ("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace_s * 1000)),
            ]
        return options


def worker_share(total: int, index: int, workers: int) -> int:
    """Worker `index`'s share of a replica-wide limit `total` split among `workers` processes:
    the shares add up to `total` (the first `total % workers` workers get one more), and none is
    below 1 (a limit smaller than the worker count is exceeded by that much)."""
    if workers <= 1:
        return total
    base, extra = divmod(total, workers)
    return max(1, base + (1 if index < extra else 0))


def _bind(
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
    what: str,
) -> int:
    """Bind a gRPC server's port (0 = a free one); `ports.PortUnavailable` when it cannot be had."""
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # grpcio: "Failed to bind to address ..."
        bound = 0
    if bound == 0:
        raise ports.unavailable(what, host, port)
    return bound


def buffer_caps(cfg: ServerConfig) -> BufferCaps:
    """The step buffers' bounds from the `--step-buffer-*` flags."""
    return BufferCaps(
        max_bytes_per_owner=cfg.step_buffer_mb_per_caller << 20,
        max_bytes_total=cfg.step_buffer_mb << 20,
        ttl_s=cfg.step_buffer_ttl_s,
    )


class RolloutServer:
    """One running replica."""

    #: What a worker process of `serve --workers N` replaces (workers/worker.py): the fleet
    #: control (it also reaches the sibling workers), the servicer (GetTrajectory from worker 0,
    #: the worker count in GetServerInfo) and the start line (the supervisor logs `serving`).
    control_class: type[Control] = Control
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
        self.auth = self._auth_config(config)
        self.rollout: Rollout
        self.control: Control
        self.weights: WeightUpdates
        self.facade: RolloutFacade
        #: RolloutStep runs (None until the servicer is built).
        self.steps: StepRunner | None = None
        #: The child processes of rule rewards (started on the first MATH/EXACT_MATCH reward).
        self.rule_processes: RuleProcesses | None = None
        self.peers: PeerAborter | None = None
        self.trajectories = TrajectoryStore()
        self.front_door: OpenAIFrontDoor | None = None
        self.openai_port: int | None = None
        #: Fleet state (step buffers): checked at start (`start` exits when it does not answer).
        self.state = self._state_store()

    def _state_store(self) -> BufferStore:
        """The store `--state-store` names (a worker of --workers N reaches its supervisor's)."""
        cfg = self.config
        return store_for(
            cfg.state_store,
            buffer_caps(cfg),
            password_file=cfg.state_store_password_file,
            ca_file=cfg.state_store_ca_file,
        )

    @staticmethod
    def _auth_config(cfg: ServerConfig) -> AuthConfig:
        tokens = TokenStore(cfg.auth_tokens_file) if cfg.auth_tokens_file else None
        cert_roles = {name: Role(role) for name, role in cfg.mtls_roles.items()}
        if cert_roles and not cfg.tls_client_ca_file:
            raise ValueError(
                "--mtls-role needs --tls-client-ca (client certificates are only verified under mTLS)"
            )
        return AuthConfig(tokens=tokens, cert_roles=cert_roles, reflection_open=cfg.reflection_open)

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
        cfg = self.config
        metadata: list[tuple[str, str]] = []
        if cfg.peer_token_file:
            token = Path(cfg.peer_token_file).read_text().strip()
            metadata.append(("authorization", f"Bearer {token}"))
        credentials = peer_channel_credentials(tls, cfg.peer_ca_file) if tls is not None else None
        return PeerAborter(
            cfg.peers,
            timeout_s=cfg.control_deadline_s,
            credentials=credentials,
            metadata=metadata,
            tls_server_name=cfg.peer_tls_name,
        )

    async def start(self) -> None:
        """Open the engine session, build the domain and the gRPC server, then serve."""
        cfg = self.config
        limit = cfg.in_flight_limit()
        tls = cfg.tls()
        self._check_exposure(tls)  # before anything listens
        await self.state.ping()  # StoreUnavailable: serve exits with one line naming the store
        session, interceptors = self._open_engine_session()
        servicer = self._build_domain(session, limit, tls)
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
        timeouts = EngineTimeouts(
            connect=cfg.engine_connect_timeout_s,
            sock_read=cfg.engine_read_timeout_s,
            idle=cfg.engine_idle_timeout_s,
        )
        self.pool = EnginePool(
            cfg.engines,
            adapter_factory(
                session,
                timeouts,
                cfg.engine_kinds,
                KindOptions(sglang_experts_topk=cfg.sglang_experts_topk),
            ),
            health_interval_s=cfg.health_interval_s,
            breaker_cooldown_s=cfg.breaker_cooldown_s,
        )
        admission = self._admission(limit)
        self.metrics = Metrics(self.pool, admission, engine_urls=cfg.metrics_engine_urls)
        #: Every call's record, of either door, goes to these (log line, metrics; tests add theirs).
        self.calls = CallBook([log_call, self.metrics.observe])
        self.rollout = Rollout(
            self.pool,
            admission,
            self.registry,
            RolloutConfig(
                max_engine_attempts=cfg.max_engine_attempts,
                engine_stream_interval=cfg.engine_stream_interval,
                deadline_margin_s=cfg.deadline_margin_s,
                deadline_abort_lead_s=cfg.deadline_abort_lead_s,
            ),
        )
        if cfg.peers:
            self.peers = self._peer_aborter(tls)
        self.control = self.control_class(
            self.pool,
            self.registry,
            self.rollout,
            deadline_s=cfg.control_deadline_s,
            peer_abort=self.peers.abort if self.peers else None,
        )
        self.trajectories = TrajectoryStore(cfg.openai.max_sessions)
        renderer = RenderService(
            self.pool, cfg.max_images, max_pixels=cfg.max_image_pixels, max_bytes=cfg.max_image_bytes
        )
        #: RolloutStep: reward models are built per step from the registry of reward kinds.
        self.rule_processes = rewards_registry.rule_processes(
            ProcessLimits(cfg.rule_reward_processes, cfg.rule_reward_timeout_s, cfg.rule_reward_memory_mb)
        )
        steps = self.steps = StepRunner(
            self.rollout,
            self.control.abort_ids,
            functools.partial(rewards_registry.build, rules=self.rule_processes),
            reward_urls=cfg.reward_urls,
            buffers=StepBuffers(self.state),
        )
        self.weights = WeightUpdates(
            self.pool,
            self.control,
            path_prefixes=cfg.weights_path_prefixes,
            load_timeout_s=cfg.weights_load_timeout_s,
            deadline_s=cfg.control_deadline_s,
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
        self.pool.capability_check = CapabilityChecker(self.config.raw_logprobs)
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
                auth_failures=AuthFailureLimiter(cfg.auth_failure_rate_per_s, cfg.auth_failure_burst),
                refusal_audit=RefusalSampler(cfg.refusal_audit_rate_per_s, cfg.refusal_audit_burst),
            ),
            *interceptors,
        ]
        server = grpc.aio.server(options=cfg.grpc_options(), interceptors=chain)
        decoding.add_rollout_service(servicer, server)
        pb_grpc.add_ReplicaServiceServicer_to_server(ReplicaServicer(self.facade), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if cfg.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, REPLICA_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                server,
            )
        self.port = _bind(
            server, cfg.host, cfg.port, server_credentials(tls) if tls is not None else None, "gRPC, --port"
        )
        if self.peers is not None:
            self.peers.set_own_port(self.port)
        return server

    async def _start_side_ports(self, tls: TlsConfig | None) -> None:
        """The optional health, OpenAI front-door and metrics ports, each when configured."""
        cfg = self.config
        if cfg.health_port is not None:
            await self._start_health_port(tls)
        if cfg.openai_port is not None:
            self.front_door = OpenAIFrontDoor(
                self.facade, cfg.openai, auth=self.auth, tls=tls, limits=cfg.request_limits()
            )
            try:
                self.openai_port = await self.front_door.start(cfg.host, cfg.openai_port)
            except OSError as exc:
                raise ports.unavailable(
                    "the OpenAI front door, --openai-port", cfg.host, cfg.openai_port, exc
                ) from None
        if cfg.metrics_port is not None:
            self._metrics_endpoint = MetricsEndpoint(self.metrics)
            try:
                self.metrics_port = await self._metrics_endpoint.start(cfg.host, cfg.metrics_port)
            except OSError as exc:
                raise ports.unavailable("metrics, --metrics-port", cfg.host, cfg.metrics_port, exc) from None

    async def _start_health_port(self, tls: TlsConfig | None) -> None:
        """A separate health-only server (plaintext when asked, so kubelet probes need no cert)."""
        cfg = self.config
        # Health requests are one service name: anything larger is refused by gRPC core unread.
        self._health_server = grpc.aio.server(
            options=[
                NO_REUSEPORT,
                ("grpc.max_receive_message_length", cfg.request_limits().max_open_request_bytes),
            ]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
        secure = tls is not None and not cfg.health_plaintext
        credentials = server_credentials(tls, require_client_cert=False) if secure and tls else None
        self.health_port = _bind(
            self._health_server, cfg.host, cfg.health_port or 0, credentials, "health, --health-port"
        )
        await self._health_server.start()

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

        `kinds` (URL -> kind, vLLM when absent) is updated in place before the pool changes, since
        the adapter factory reads that table when an engine joins. An engine already in the pool
        keeps its adapter."""
        self.config.engine_kinds.clear()
        self.config.engine_kinds.update(kinds or {})
        self.config.engines = list(urls)
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
        if self.peers is not None:
            await self.peers.close()
        await self.state.close()
        if self._session is not None:
            await self._session.close()
