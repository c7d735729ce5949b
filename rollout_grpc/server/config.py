"""The replica's configuration, in one place: the sections (typed, frozen sub-configs) and
`ServerConfig`, their union.

Each section is the sub-config of one `serve --help` section (`SECTION`, its title): the flags of
that section (`settings/table.py` rows, `settings/groups.py`) fill its fields and nothing else.
`settings/` fills a `ServerConfig` from the command line, the environment and a TOML file; the
wiring (`app.py`) and the worker supervisor read it, hand each room its section
(`ServerConfig.section`) or the room's own config built by a section's method (`engine_timeouts`,
`request_limits`, `buffer_caps`, ...), so the wiring holds no field-by-field carving, and the
settings import nothing of the wiring or the doors (nor the server anything of the settings).
A new setting is a field of its section here, one row in `settings.FLAGS` and its name in that
section of `settings.FLAG_GROUPS` (tests/ops/test_config_sections.py fails until all three agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar

from rollout_grpc.server.domain import bounds
from rollout_grpc.server.domain import model as domain
from rollout_grpc.server.domain.trajectory import DriftPolicy
from rollout_grpc.server.engines.api import EngineTimeouts
from rollout_grpc.server.engines.registry import KindOptions
from rollout_grpc.server.ports import NO_REUSEPORT
from rollout_grpc.server.rewards import allowlist as reward_allowlist
from rollout_grpc.server.rewards.processes import ProcessLimits
from rollout_grpc.server.rollout.generation import RolloutConfig
from rollout_grpc.server.rollout.weights import DEFAULT_LEASE_TTL_S, DEFAULT_LOAD_TIMEOUT_S
from rollout_grpc.server.security.limits import RequestLimits
from rollout_grpc.server.security.tls import TlsConfig
from rollout_grpc.server.state.api import BufferCaps
from rollout_grpc.server.state.trajectories import TrajectoryCaps

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

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


# ---- checks of field values (the settings run them on every flag that sets the field) ----------

#: The tool-call parsers of the OpenAI door (`FrontDoorConfig.tool_parser`; the classes are
#: `front/openai/tools.PARSERS`, which a test holds to these names).
TOOL_PARSERS: tuple[str, ...] = ("hermes", "none")
#: A peer dialed through DNS (every address the name resolves to is a peer).
DNS_PREFIX = "dns:///"


def peer_problem(peer: str) -> str | None:
    """Why `peer` is not `host:port` or `dns:///name:port`, or None (checked at start: a peer
    without a port would be dialed at gRPC's default 443, or fail every abort it is asked for)."""
    address = peer.removeprefix(DNS_PREFIX)
    host, colon, port = address.rpartition(":")
    if "://" in address or "/" in address or not colon or not host.strip("[]") or host.endswith(":"):
        return f"{peer!r}: a peer is host:port or dns:///name:port"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{peer!r}: the port must be a number 1-65535, got {port!r}"
    return None


def reward_url_problem(prefix: str) -> str | None:
    """Why `prefix` cannot be an allowed REMOTE reward URL prefix (`ServerConfig.reward_urls`),
    or None; the rewards room's own parsed-URL check."""
    return reward_allowlist.prefix_problem(prefix)


# ---- the sections: one frozen sub-config per `serve --help` section (settings/groups.py) -------
#
# Each section declares the fields its flags fill, once: the field's type, its default (the flag's
# default, settings/flag.py) and why it exists. `SECTION` is the title of the `--help` section whose
# flags fill it (`settings.FLAG_GROUPS` takes its titles from here), so a flag's row (table.py), its
# section and the field it fills read together; tests/ops/test_config_sections.py holds every flag
# to one field of its own section's sub-config and every field to a flag or a reason (NOT_FLAGS).
# `ServerConfig` is the union of the sections (dataclass inheritance: every field is a
# `ServerConfig` field, so flat construction and reads keep working); `ServerConfig.section(T)`
# takes one section out as its own frozen value, which is what the wiring hands a room.


@dataclass(frozen=True, slots=True)
class FrontDoorConfig:
    """Knobs of the front door (`ServerConfig.openai`; `--openai-port` turns it on)."""

    drift_policy: DriftPolicy = DriftPolicy.KEEP_PREFIX
    tool_parser: str = "hermes"
    #: Live sessions per caller identity in the state store (a new one beyond it is refused, never
    #: evicted: one caller cannot push out another's); `--openai-max-sessions-per-caller`.
    max_sessions: int = 10_000
    #: MiB of recorded turns per caller identity in the state store (a turn beyond it is refused);
    #: `--openai-session-mb-per-caller`. Sized in docs/agentic.md (~20 bytes a token with logprobs).
    max_session_mb: int = 1024
    #: Seconds a session is kept after its last turn (and a collected id stays its owner's);
    #: `--openai-session-ttl-s`. A harness slower than this between turns loses its session.
    session_ttl_s: float = 24 * 3600.0
    #: Record routed experts (R3) per turn; the engines must run with --enable-return-routed-experts.
    return_routed_experts: bool = False
    stream_batch_tokens: int = 16
    stream_batch_interval_s: float = 0.02
    #: Seconds a request body may take to arrive (408 after it).
    body_timeout_s: float = 30.0


@dataclass(frozen=True, kw_only=True)
class EnginesConfig:
    """The engines and every engine call: the pool, its probes, timeouts, failover."""

    SECTION: ClassVar[str] = "engines"

    engines: list[str]
    #: The kind of each engine URL that is not vLLM ("sglang"), as the settings read it from a
    #: `sglang+http://...` URL; the registry picks each engine's adapter from it.
    engine_kinds: dict[str, str] = field(default_factory=dict)
    #: The engines are simulated (`--sim`): said loudly in the log and in GetServerInfo.
    simulated_engines: bool = False
    #: Engines whose logprobs mode is vLLM's default `raw_logprobs`: "refuse" (not routed to) or
    #: "warn" (routed to, with a warning in the log and in GetServerInfo).
    raw_logprobs: str = "warn"
    #: The MoE model's `num_experts_per_tok`, which SGLang's shape-less R3 bytes need (None: R3 is
    #: off on SGLang engines, with a warning in their capabilities).
    sglang_experts_topk: int | None = None
    health_interval_s: float = 2.0
    breaker_cooldown_s: float = 5.0
    engine_connect_timeout_s: float = 5.0
    engine_read_timeout_s: float | None = None
    #: Seconds of silence on an engine stream before the engine is probed (failover if it is dead).
    engine_idle_timeout_s: float = 30.0
    max_engine_attempts: int = 4
    engine_stream_interval: bool = True

    def engine_timeouts(self) -> EngineTimeouts:
        """Timeouts of every engine call (`--engine-connect-timeout`, `--engine-*-timeout`)."""
        return EngineTimeouts(
            connect=self.engine_connect_timeout_s,
            sock_read=self.engine_read_timeout_s,
            idle=self.engine_idle_timeout_s,
        )

    def kind_options(self) -> KindOptions:
        """What an engine kind's adapter needs that its engine does not report."""
        return KindOptions(sglang_experts_topk=self.sglang_experts_topk)


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """The gRPC port and its channel: address, health port, peers, message and connection limits."""

    SECTION: ClassVar[str] = "network"

    host: str = "127.0.0.1"
    port: int = 50051
    #: Separate health port (0 = pick a free one, None = health on the main port only).
    health_port: int | None = 0
    peers: list[str] = field(default_factory=list)
    max_receive_message_mb: int = 64
    max_send_message_mb: int = 256
    max_connection_age_s: float | None = 300.0
    max_connection_age_grace_s: float = 3600.0
    keepalive_time_s: float = 60.0
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
    #: Bind the gRPC port with SO_REUSEPORT: only a worker, whose supervisor reserved the port
    #: (workers/reservation.py), ever sets it; a replica of its own keeps a busy port an error.
    reuse_port: bool = False


@dataclass(frozen=True, kw_only=True)
class SecurityConfig:
    """TLS, authentication, reflection and the refusals' rate limits (docs/security.md)."""

    SECTION: ClassVar[str] = "TLS and authentication (docs/security.md)"

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
    #: Every host that can reach `host` is trusted: serve a network address without authentication
    #: or send tokens without TLS (refused otherwise; exposure.py). `--insecure-trusted-network`.
    insecure_trusted_network: bool = False
    #: Token this replica presents to its peers (a `peer` or `admin` line of their tokens file).
    peer_token_file: str | None = None
    #: CA that verifies the peers' certificates (default: the client CA, else the system roots).
    peer_ca_file: str | None = None
    #: Name the peers' certificates are checked against (peers are dialed by IP when resolved).
    peer_tls_name: str | None = None
    #: Serve gRPC server reflection; with authentication on it needs a credential unless open.
    reflection: bool = True
    reflection_open: bool = False
    #: Failed authentications per peer address: burst (0 = unlimited), then this rate; past it
    #: RESOURCE_EXHAUSTED (a valid credential still gets in). security/refusals.py.
    auth_failure_rate_per_s: float = 1.0
    auth_failure_burst: int = 20
    #: Audit lines of refused control RPCs: burst (0 = every one), then this rate; the rest counted.
    refusal_audit_rate_per_s: float = 1.0
    refusal_audit_burst: int = 20

    def tls(self) -> TlsConfig | None:
        """The TLS settings, or None for plaintext; a key without a certificate is a config error."""
        if not self.tls_cert_file and not self.tls_key_file:
            if self.tls_client_ca_file:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not (self.tls_cert_file and self.tls_key_file):
            raise ValueError("--tls-cert and --tls-key go together")
        return TlsConfig(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """Admission (the in-flight limit and the queue), per-caller limits and the control fan-outs."""

    SECTION: ClassVar[str] = "admission and control"

    server_concurrency: int = 512
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int = 1
    max_queue: int = 4096
    retry_after_s: float = 1.0
    #: Generations (running + queued) one authenticated caller may hold; 0 = half of the in-flight
    #: limit plus the queue, so that one trainer cannot starve the others.
    max_in_flight_per_caller: int = 0
    #: Control RPCs (Abort, Pause, Resume) per caller: sustained rate (0 = unlimited) and burst.
    control_rate_per_s: float = 10.0
    control_burst: int = 50
    #: One overall deadline for Abort(all), Pause (ABORT, KEEP) and Resume fan-outs (bounds.py).
    control_deadline_s: float = bounds.CONTROL_DEADLINE_S


@dataclass(frozen=True, kw_only=True)
class BoundsConfig:
    """Request bounds (limits.RequestLimits) and the Render images' bounds, applied by each door."""

    SECTION: ClassVar[str] = "request bounds"

    max_images: int = 8
    #: Largest image accepted by Render, in pixels (width x height, read from the header before
    #: decoding: decompression bombs are refused unopened) and in encoded bytes.
    max_image_pixels: int = 64_000_000
    max_image_bytes: int = 32 * 1024 * 1024
    max_abort_ids: int = 1024
    max_metadata_bytes: int = 1 << 20
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_chat_template_kwargs_bytes: int = 64 << 10
    #: Characters of prompt text of one chat render (front-door turn, Render RPC), before the engine.
    max_prompt_chars: int = 4 << 20
    #: Serialized request of every RPC but Generate, RolloutStep and Render, checked before decoding.
    max_control_request_bytes: int = 1 << 20

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


@dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    """How a generation streams (the server-wide `GenerateOptions`) and ends before its deadline."""

    SECTION: ClassVar[str] = "streaming and deadlines"

    #: Most seconds before a caller's deadline that a generation ends with its sample (ABORTED,
    #: every token kept); 10 % of the caller's time when that is less (bounds.py).
    deadline_margin_s: float = bounds.DEADLINE_MARGIN_S
    #: Most seconds before that the engine call is aborted upstream so that the engine's final
    #: chunk (every token it made) arrives in time; 10 % of the caller's time, at least 50 ms,
    #: when that is less (bounds.py, rollout/deadline.py).
    deadline_abort_lead_s: float = bounds.DEADLINE_ABORT_LEAD_S
    default_options: domain.GenerateOptions = field(default_factory=domain.GenerateOptions)


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """RolloutStep: where its rewards and environments may POST, its plugins, rule-reward
    processes and its buffers."""

    SECTION: ClassVar[str] = "RolloutStep and rewards (docs/rollout-step.md)"

    #: URL prefixes a RolloutStep's REMOTE reward may POST to (empty: any). A reward URL makes the
    #: replica send requests where the caller says: pin it to the reward servers you run.
    reward_urls: list[str] = field(default_factory=list)
    #: RolloutStep plugins enabled by entry point name (`--step-plugin`; "*": all installed).
    step_plugins: list[str] = field(default_factory=list)
    #: URL prefixes a RolloutStep's episode environment may POST to (empty: any), for the same reason.
    env_urls: list[str] = field(default_factory=list)
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
    #: Seconds a step's drain lease lives after its last renewal (renewed every third of it): how
    #: long a killed replica's step delays the caller's next continue step, and how long a replica
    #: may lose the store before its step's groups are reported lost (docs/rollout-step.md).
    step_drain_lease_ttl_s: float = 15.0

    def rule_process_limits(self) -> ProcessLimits:
        """The bounds of rule rewards in one replica process (`--rule-reward-*`)."""
        return ProcessLimits(
            self.rule_reward_processes, self.rule_reward_timeout_s, self.rule_reward_memory_mb
        )

    def buffer_caps(self) -> BufferCaps:
        """The step buffers' bounds from the `--step-buffer-*` flags (every store applies them)."""
        return BufferCaps(
            max_bytes_per_owner=self.step_buffer_mb_per_caller << 20,
            max_bytes_total=self.step_buffer_mb << 20,
            ttl_s=self.step_buffer_ttl_s,
            lease_ttl_s=self.step_drain_lease_ttl_s,
        )


@dataclass(frozen=True, kw_only=True)
class StateStoreConfig:
    """Where fleet state lives (server/state)."""

    SECTION: ClassVar[str] = "fleet state (docs/architecture.md)"

    #: "" this process (the supervisor's with --workers), or redis://host:port/db, rediss://...
    #: shared by every replica; the password from a file.
    state_store: str = ""
    state_store_password_file: str | None = None
    state_store_ca_file: str | None = None


@dataclass(frozen=True, kw_only=True)
class WeightsConfig:
    """UpdateWeights: which checkpoints it may load, how long, and the fleet's lease."""

    SECTION: ClassVar[str] = "weight updates (docs/engines.md)"

    #: Directories UpdateWeights may name checkpoints under (`--weights-path-prefix`; empty: off).
    weights_path_prefixes: list[str] = field(default_factory=list)
    #: Seconds one engine may take to load a checkpoint (`--weights-load-timeout`).
    weights_load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    #: Seconds the fleet's weight-update lease outlives a holder that stopped renewing it
    #: (`--weights-lease-ttl`): how long a replica killed mid-update blocks the others.
    weights_lease_ttl_s: float = DEFAULT_LEASE_TTL_S


@dataclass(frozen=True, kw_only=True)
class OpenAIConfig:
    """The OpenAI-compatible front door: its port, and the door's own knobs (`FrontDoorConfig`)."""

    SECTION: ClassVar[str] = "OpenAI front door (docs/agentic.md)"

    #: Port of the OpenAI-compatible front door (0 = pick a free one, None = off); docs/agentic.md.
    openai_port: int | None = None
    openai: FrontDoorConfig = field(default_factory=FrontDoorConfig)


@dataclass(frozen=True, kw_only=True)
class WorkersConfig:
    """Worker processes (`serve --workers N`, docs/workers.md) and the graceful stop's times."""

    SECTION: ClassVar[str] = "workers and shutdown (docs/workers.md)"

    #: Replacements of dead workers the supervisor makes within `worker_restart_window_s` before it
    #: stops the replica (exit 1); each after an exponential back-off (workers/supervisor.py).
    worker_restarts: int = 5
    worker_restart_window_s: float = 60.0
    grace_s: float = 30.0
    #: After the grace: time the aborted generations get to end as samples (bounds.py).
    abort_grace_s: float = bounds.SHUTDOWN_ABORT_DRAIN_S


@dataclass(frozen=True, kw_only=True)
class ObserveConfig:
    """The metrics endpoint and tracing (docs/operations.md)."""

    SECTION: ClassVar[str] = "observability (docs/operations.md)"

    #: Port of the Prometheus /metrics endpoint (0 = any free port, None = no endpoint).
    metrics_port: int | None = None
    #: Label engine series with their URLs (default: the `engine-<8 hex>` labels non-admins see;
    #: the endpoint has no authentication).
    metrics_engine_urls: bool = False
    #: OTLP/gRPC collector for OpenTelemetry traces ("" = tracing off; needs the `tracing` extra).
    otlp_endpoint: str = ""


#: The sections, in the order of `serve --help` (settings/groups.py).
SECTIONS: Final[tuple[type[Any], ...]] = (
    EnginesConfig,
    NetworkConfig,
    SecurityConfig,
    AdmissionConfig,
    BoundsConfig,
    StreamingConfig,
    StepConfig,
    StateStoreConfig,
    WeightsConfig,
    OpenAIConfig,
    WorkersConfig,
    ObserveConfig,
)

_Section = TypeVar("_Section", bound="DataclassInstance")


@dataclass(frozen=True, kw_only=True)
class ServerConfig(
    EnginesConfig,
    NetworkConfig,
    SecurityConfig,
    AdmissionConfig,
    BoundsConfig,
    StreamingConfig,
    StepConfig,
    StateStoreConfig,
    WeightsConfig,
    OpenAIConfig,
    WorkersConfig,
    ObserveConfig,
):
    """Everything a replica needs to start: the union of the sections above, and nothing else.

    A field is declared in its section, never here (a test refuses a field of its own). Frozen: a
    worker's share of the limits and a reloaded engine list are new configs (`dataclasses.replace`).
    The methods here combine sections (the in-flight limit reads the engines and admission).
    """

    SECTION: ClassVar[str] = ""

    def section(self, kind: type[_Section]) -> _Section:
        """The section `kind` (one of `SECTIONS`) as its own frozen value: what a room is handed."""
        make: Callable[..., _Section] = kind  # a section's dataclass __init__ takes its fields
        return make(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    def rollout_config(self) -> RolloutConfig:
        """The generation loop's knobs (attempts, upstream batching, deadline margins)."""
        return RolloutConfig(
            max_engine_attempts=self.max_engine_attempts,
            engine_stream_interval=self.engine_stream_interval,
            deadline_margin_s=self.deadline_margin_s,
            deadline_abort_lead_s=self.deadline_abort_lead_s,
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


def trajectory_caps(cfg: ServerConfig) -> TrajectoryCaps:
    """The recorded agent sessions' bounds (`FrontDoorConfig`; every store applies them)."""
    return TrajectoryCaps(
        max_sessions_per_owner=max(1, cfg.openai.max_sessions),
        max_bytes_per_owner=cfg.openai.max_session_mb << 20,
        ttl_s=cfg.openai.session_ttl_s,
    )


def buffer_caps(cfg: StepConfig) -> BufferCaps:
    """The step buffers' bounds from the `--step-buffer-*` flags (every store applies them)."""
    return cfg.buffer_caps()
