"""The `serve` command's settings: one source of defaults, three sources of values.

Defaults live in ONE place, the dataclasses `ServerConfig` (`server/config.py`), `GenerateOptions`
(`server/domain/model.py`) and `FrontDoorConfig` (`server/config.py`); the command-line flags are
derived from their fields through the `FLAGS` table below, which adds only a flag name, a help text
and a unit. `tests/ops/test_settings.py` checks that every `ServerConfig` and `FrontDoorConfig`
field is a flag or is listed in `NOT_FLAGS` / `NOT_OPENAI_FLAGS`.

Every flag can be given three ways; the first one found wins:

1. on the command line (`--grace 10`);
2. in the environment as `ROLLOUT_GRPC_<FLAG>` (`ROLLOUT_GRPC_GRACE=10`; list flags such as
   `--engine` take comma-separated values; switches take 1/0, true/false, yes/no, on/off);
3. in a TOML file given by `--config FILE` (or `ROLLOUT_GRPC_CONFIG`), with the flag names as keys
   (`grace = 10`, `engine = ["http://vllm-0:8000"]`; `-` and `_` are interchangeable);

and otherwise the dataclass default applies.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn
from urllib.parse import urlsplit

from rollout_grpc.argtypes import MAX_PORT, unrecognized_message
from rollout_grpc.argtypes import number as ranged_number
from rollout_grpc.server.config import (
    TOOL_PARSERS,
    FrontDoorConfig,
    ServerConfig,
    peer_problem,
    reward_url_problem,
)
from rollout_grpc.server.domain.model import GenerateOptions
from rollout_grpc.server.domain.vocabulary import EngineKind

ENV_PREFIX: Final = "ROLLOUT_GRPC_"

#: ServerConfig fields that are deliberately not flags, and why.
NOT_FLAGS: Final[dict[str, str]] = {
    "default_options": "its server-wide fields are flags of their own (--stream-batch-*)",
    "simulated_engines": "set by --sim, never by hand",
    "engine_kinds": "read from the KIND+ prefix of each engine URL (--engine, --engines-file)",
    "openai": "a FrontDoorConfig, whose fields are flags of their own (--openai-*) or in NOT_OPENAI_FLAGS",
    "reuse_port": "set per worker by the `serve --workers` supervisor (the port it reserved)",
}

#: FrontDoorConfig (`ServerConfig.openai`) fields that are not flags yet, and why.
NOT_OPENAI_FLAGS: Final[dict[str, str]] = {
    "max_sessions": "sessions kept per caller; the default (10 000) is sized in docs/agentic.md, set in code",
    "return_routed_experts": "R3 per turn needs MoE engines started for it; set in code (docs/agentic.md)",
    "stream_batch_tokens": "the front door's own stream batching, measured in docs/benchmarks.agentic.md",
    "stream_batch_interval_s": "the front door's own stream batching, measured in docs/benchmarks.agentic.md",
}

#: The drift policies (`trajectory.DriftPolicy`), reached through the field's type.
_DRIFT_POLICY: Final = type(FrontDoorConfig().drift_policy)

#: ROLLOUT_GRPC_* variables that are read elsewhere, hence no misspelling of a setting.
OTHER_VARIABLES: Final[dict[str, str]] = {
    ENV_PREFIX + "CONFIG": "serve --config",
    ENV_PREFIX + "TARGET": "the replica address of the clients' examples and of the slime hook",
    ENV_PREFIX + "ALLOW_UNTESTED_PYTHON": "the server's Python version check (server/environment.py)",
}
#: Families of ROLLOUT_GRPC_* variables read elsewhere: `rollout-grpc info`'s connection flags, the
#: slime hook's credentials.
OTHER_PREFIXES: Final = (ENV_PREFIX + "INFO_", ENV_PREFIX + "CLIENT_")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag.

    `field` names the `ServerConfig` field it sets ("default_options.x" for a `GenerateOptions`
    field, "openai.x" for a `FrontDoorConfig` one; "" for a flag of the command itself, whose
    default is `default`). A flag's value is
    the field's value times `scale` (milliseconds for a field in seconds). `zero_is_none` maps
    0 to None for fields where None means "off".
    """

    name: str
    help: str
    field: str = ""
    kind: str = "value"  # "value", "list" (repeatable), "switch" (store_true), "off-switch"
    type: Callable[[str], Any] | None = None
    scale: float = 1.0
    zero_is_none: bool = False
    choices: tuple[str, ...] | None = None
    default: Any = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    #: Turns the parsed value into the field's value (e.g. `NAME=ROLE` items into a dict).
    to_field: Callable[[Any], Any] | None = None

    @property
    def dest(self) -> str:
        """The argparse destination (flag name with underscores)."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        """The environment variable that may set this flag."""
        return ENV_PREFIX + self.dest.upper()


def _mtls_roles(items: list[str]) -> dict[str, str]:
    """`NAME=ROLE` items as a dict; the role must be one of trainer, admin, peer."""
    roles: dict[str, str] = {}
    for item in items:
        name, sep, role = item.rpartition("=")
        if not sep or not name or role not in ("trainer", "admin", "peer"):
            raise SettingsError(f"--mtls-role: expected NAME=trainer|admin|peer, got {item!r}")
        roles[name] = role
    return roles


@dataclass(frozen=True, slots=True)
class EngineURL:
    """One engine: its base URL (a plain `http(s)://host[:port]` string, what `ServerConfig.engines`
    holds) and its kind (`sglang+http://...`; vLLM when there is no prefix)."""

    url: str
    kind: EngineKind = EngineKind.VLLM


_ENGINE_FORM = "expected http(s)://HOST[:PORT], optionally prefixed vllm+ or sglang+"


def parse_engine_url(text: str) -> EngineURL:
    """Check one engine URL and split off its kind; ValueError says what is wrong with it.

    Checked when the settings are read rather than when the first HTTP call fails: `127.0.0.1:8100`
    (no scheme) used to get as far as aiohttp and end `serve` in a long traceback."""
    value = text.strip()
    scheme, sep, rest = value.partition("://")
    if not sep:
        raise ValueError(f"{text!r}: no scheme ({_ENGINE_FORM})")
    kind, scheme = _engine_kind(scheme, text)
    parts = urlsplit(f"{scheme}://{rest}")
    if "@" in parts.netloc:
        raise ValueError(f"{text!r}: credentials in the URL are not supported")
    if not parts.hostname:
        raise ValueError(f"{text!r}: no host ({_ENGINE_FORM})")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or parts.netloc.endswith(":"):
        raise ValueError(f"{text!r}: the port is not a number from 1 to 65535")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"{text!r}: path {parts.path!r}: give the engine's base URL (the service adds the API paths)"
        )
    if parts.query or parts.fragment or "?" in rest or "#" in rest:
        raise ValueError(f"{text!r}: a query or fragment has no place in an engine's base URL")
    return EngineURL(f"{parts.scheme}://{parts.netloc}", kind)


def _engine_kind(scheme: str, text: str) -> tuple[EngineKind, str]:
    """The kind named by a `KIND+` prefix of `scheme` (vLLM without one) and the bare scheme."""
    kind_text, plus, bare = scheme.rpartition("+")
    kind = EngineKind.VLLM
    if plus:
        try:
            kind = EngineKind(kind_text.lower())
        except ValueError:
            known = ", ".join(sorted(k.value for k in EngineKind))
            raise ValueError(f"{text!r}: unknown engine kind {kind_text!r} (known: {known})") from None
    if bare.lower() not in ("http", "https"):
        raise ValueError(f"{text!r}: scheme {bare!r} is not http or https ({_ENGINE_FORM})")
    return kind, bare.lower()


def _engine_argument(text: str) -> str:
    """`parse_engine_url` as an argparse type (argparse shows only ArgumentTypeError messages)."""
    try:
        parse_engine_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _checked(problem_of: Callable[[str], str | None]) -> Callable[[str], str]:
    """An argparse type: the stripped value, or ArgumentTypeError with what `problem_of` found."""

    def argument(text: str) -> str:
        problem = problem_of(text.strip())
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return text.strip()

    return argument


#: `--peer`: host:port or dns:///name:port.
_peer_argument = _checked(peer_problem)
#: `--reward-url`: scheme://host[:port][/path].
_reward_prefix = _checked(reward_url_problem)


def _weights_prefix(text: str) -> str:
    """`--weights-path-prefix`: an absolute, normal directory path."""
    path = text.strip().rstrip("/") or "/"
    if not path.startswith("/") or os.path.normpath(path) != path:
        raise argparse.ArgumentTypeError(f"must be an absolute, normal directory path; got {text!r}")
    return path


FLAGS: Final[tuple[Flag, ...]] = (
    Flag(
        "--engine",
        "engine base URL, http(s)://HOST[:PORT] (repeatable); a vllm+ or sglang+ prefix names the "
        "engine kind (default vllm)",
        "engines",
        kind="list",
        type=_engine_argument,
        metavar="URL",
    ),
    Flag(
        "--reward-url",
        "URL prefix a RolloutStep's remote reward may use: the same scheme, host and port, a path at "
        "or under it (repeatable; none given: any http(s) URL)",
        "reward_urls",
        kind="list",
        type=_reward_prefix,
        metavar="URL",
    ),
    Flag(
        "--step-plugin",
        "enable an installed RolloutStep plugin by its entry point name (groups rollout_grpc.step_rewards "
        "and rollout_grpc.step_filters; repeatable; '*': every installed one; none given: plugins off)",
        "step_plugins",
        kind="list",
        metavar="NAME",
    ),
    Flag(
        "--env-url",
        "URL prefix a RolloutStep's episode environment may use: the same scheme, host and port, a "
        "path at or under it (repeatable; none given: any http(s) URL; docs/episodes.md)",
        "env_urls",
        kind="list",
        type=_reward_prefix,
        metavar="URL",
    ),
    Flag(
        "--rule-reward-processes",
        "child processes computing rule rewards (MATH, EXACT_MATCH) per replica process",
        "rule_reward_processes",
    ),
    Flag(
        "--rule-reward-timeout-s",
        "seconds one rule reward may compute before its child process is killed (a reward failure)",
        "rule_reward_timeout_s",
    ),
    Flag(
        "--rule-reward-memory-mb",
        "address-space limit of one rule-reward child process, MiB (over it: a reward failure)",
        "rule_reward_memory_mb",
    ),
    Flag(
        "--step-buffer-mb-per-caller",
        "estimated MiB of RolloutStep groups one caller may keep buffered (over it: handed back)",
        "step_buffer_mb_per_caller",
    ),
    Flag(
        "--step-buffer-mb",
        "estimated MiB of RolloutStep groups buffered for all callers of one state store",
        "step_buffer_mb",
    ),
    Flag(
        "--step-buffer-ttl-s",
        "seconds a caller's buffered groups live after its last write (then reported lost)",
        "step_buffer_ttl_s",
    ),
    Flag(
        "--state-store",
        "where fleet state lives: empty for this process (the supervisor's with --workers), or "
        "redis://HOST:PORT/DB, rediss://... (TLS) shared by every replica (docs/architecture.md)",
        "state_store",
        type=str,
        metavar="URL",
    ),
    Flag(
        "--state-store-password-file",
        "file holding the state store's password (never on the command line)",
        "state_store_password_file",
        type=str,
    ),
    Flag(
        "--state-store-ca-file",
        "PEM CA that signed a rediss:// state store's certificate (default: the system's)",
        "state_store_ca_file",
        type=str,
    ),
    Flag("--engines-file", "file with one engine URL per line (# comments); re-read on SIGHUP", type=str),
    Flag(
        "--sim",
        "run N simulated engines in this process instead of real ones (demos and tests only)",
        type=int,
        default=0,
        aliases=("--sim-engines",),
        metavar="N",
    ),
    Flag(
        "--workers",
        "worker processes serving the gRPC port, one replica to the outside (default: the cores this "
        "process may run on; 1 = one process, no supervisor). The serve process then supervises them: "
        "worker 0 runs the OpenAI front door and the health port, the supervisor serves the merged "
        "metrics (label `worker`), the in-flight limit is shared, the queue divided (docs/workers.md)",
        type=int,
    ),
    Flag(
        "--worker-restarts",
        "a worker that dies is replaced (after 0.5 s, 1 s, 2 s, ... at most 10 s) up to this many "
        "times within --worker-restart-window; one more death stops the replica (exit 1)",
        "worker_restarts",
    ),
    Flag(
        "--worker-restart-window",
        "seconds over which --worker-restarts counts the replacements of dead workers",
        "worker_restart_window_s",
    ),
    Flag("--sim-token-delay-ms", "per-token delay of the simulated engines", type=float, default=0.0),
    Flag("--host", "address to bind the gRPC (and health and metrics) ports to", "host"),
    Flag("--port", "gRPC port (0 = any free port)", "port"),
    Flag("--health-port", "separate grpc.health.v1 port (0 = any free port)", "health_port"),
    Flag("--metrics-port", "Prometheus /metrics HTTP port (0 = any free port; unset = off)", "metrics_port"),
    Flag(
        "--metrics-engine-urls",
        "label engine metrics with the engine URLs instead of engine-<hex> labels (the metrics port "
        "has no authentication: only where admins alone reach it)",
        "metrics_engine_urls",
        kind="switch",
    ),
    Flag(
        "--otlp-endpoint",
        "OpenTelemetry OTLP/gRPC collector (host:port) for traces; needs the [tracing] extra; unset = off",
        "otlp_endpoint",
    ),
    Flag(
        "--raw-logprobs",
        "engines whose --logprobs-mode is raw_logprobs (vLLM's default): refuse them or only warn",
        "raw_logprobs",
        choices=("refuse", "warn"),
    ),
    Flag("--server-concurrency", "in-flight generations per engine", "server_concurrency"),
    Flag(
        "--rollout-num-gpus",
        "GPUs of the rollout fleet; with --rollout-num-gpus-per-engine sizes admission (unset = one "
        "engine per URL)",
        "rollout_num_gpus",
    ),
    Flag("--rollout-num-gpus-per-engine", "GPUs per engine", "rollout_num_gpus_per_engine"),
    Flag("--max-queue", "generations that may wait for a slot before RESOURCE_EXHAUSTED", "max_queue"),
    Flag("--retry-after", "seconds of retry hint sent with RESOURCE_EXHAUSTED", "retry_after_s"),
    Flag("--grace", "seconds in-flight generations get at shutdown", "grace_s"),
    Flag(
        "--abort-grace",
        "seconds aborted generations get to return their samples at shutdown",
        "abort_grace_s",
    ),
    Flag("--health-interval", "seconds between engine /health probes", "health_interval_s"),
    Flag("--breaker-cooldown", "seconds a failed engine stays out of rotation", "breaker_cooldown_s"),
    Flag("--engine-connect-timeout", "seconds to connect to an engine", "engine_connect_timeout_s"),
    Flag(
        "--engine-read-timeout",
        "seconds of silence allowed in an engine stream (0 = no limit)",
        "engine_read_timeout_s",
        zero_is_none=True,
    ),
    Flag(
        "--engine-idle-timeout",
        "seconds an engine stream may stay silent before the engine is probed (and failed over "
        "if it does not answer); a paused engine that answers is waited for",
        "engine_idle_timeout_s",
    ),
    Flag(
        "--sglang-experts-topk",
        "the MoE model's num_experts_per_tok, for R3 on SGLang engines: SGLang returns routed "
        "experts as raw int32 without a shape and does not report it (unset: R3 off on SGLang)",
        "sglang_experts_topk",
        type=int,
        zero_is_none=True,
        metavar="K",
    ),
    Flag(
        "--max-engine-attempts", "engine calls per Generate (the first plus failovers)", "max_engine_attempts"
    ),
    Flag(
        "--deadline-margin",
        "at most this many seconds before a caller's deadline (10 %% of its time if less) a "
        "generation ends with its sample, ABORTED with every token",
        "deadline_margin_s",
    ),
    Flag(
        "--deadline-abort-lead",
        "at most this many seconds before that (10 %% of the caller's time, at least 50 ms, if "
        "less) the engine call is aborted upstream, so the engine's final chunk with every token "
        "arrives before the sample is sent; 0 sends the abort only at the margin",
        "deadline_abort_lead_s",
    ),
    Flag(
        "--no-engine-stream-interval",
        "never ask engines for stream_interval batching (for engines that reject it)",
        "engine_stream_interval",
        kind="off-switch",
    ),
    Flag("--stream-batch-tokens", "tokens per streamed delta", "default_options.stream_batch_tokens"),
    Flag(
        "--stream-batch-interval-ms",
        "a delta is sent once its oldest token is this old",
        "default_options.stream_batch_interval_s",
        scale=1000.0,
    ),
    Flag("--max-receive-message-mb", "largest gRPC request", "max_receive_message_mb"),
    Flag("--max-send-message-mb", "largest gRPC response", "max_send_message_mb"),
    Flag(
        "--max-connection-age",
        "seconds before a client connection is asked to reconnect, for L4 rebalancing (0 = never)",
        "max_connection_age_s",
        zero_is_none=True,
    ),
    Flag(
        "--max-connection-age-grace",
        "seconds calls get after a connection's age",
        "max_connection_age_grace_s",
    ),
    Flag("--keepalive-time", "seconds between HTTP/2 keepalive pings", "keepalive_time_s"),
    Flag(
        "--peer",
        "another replica (host:port), or dns:///name:port resolved to every replica at each abort",
        "peers",
        kind="list",
        type=_peer_argument,
        metavar="ADDRESS",
    ),
    Flag("--max-images", "images per Render request", "max_images"),
    Flag(
        "--max-image-pixels", "pixels of one image (read from its header before decoding)", "max_image_pixels"
    ),
    Flag("--max-image-bytes", "encoded bytes of one image", "max_image_bytes"),
    Flag(
        "--control-deadline",
        "seconds the Abort(all)/Pause/Resume fan-out may take, retries included (Pause WAIT: no limit)",
        "control_deadline_s",
    ),
    Flag(
        "--max-unrequested-time",
        "seconds gRPC core may hold a call the busy event loop has not picked up yet before cancelling it",
        "max_unrequested_time_s",
    ),
    Flag(
        "--max-pending-calls",
        "calls gRPC core may hold before the event loop picks them up, before it refuses any unseen "
        "(0 = in-flight limit + queue + 1000)",
        "max_pending_calls",
    ),
    Flag(
        "--openai-port",
        "serve the OpenAI-compatible agent front door on this port (0 = any free port; unset = off)",
        "openai_port",
    ),
    Flag(
        "--openai-tool-parser",
        "how the front door finds tool calls in generated text: hermes (<tool_call> JSON blocks, "
        "as vLLM's --tool-call-parser hermes) or none (all text is content); docs/agentic.md",
        "openai.tool_parser",
        choices=tuple(sorted(TOOL_PARSERS)),
    ),
    Flag(
        "--openai-body-timeout",
        "seconds a front-door request body may take to arrive (then 408)",
        "openai.body_timeout_s",
    ),
    Flag(
        "--openai-drift-policy",
        "a turn whose re-rendered prompt does not extend the recorded tokens: keep_prefix (send the "
        "recorded tokens, one sample per session) or split (send the template's rendering, start a "
        "new sample); docs/agentic.md",
        "openai.drift_policy",
        choices=tuple(p.value for p in _DRIFT_POLICY),
        to_field=_DRIFT_POLICY,
    ),
    # --- security (docs/security.md) ---
    Flag("--tls-cert", "PEM server certificate chain: TLS on the gRPC and health ports", "tls_cert_file"),
    Flag("--tls-key", "PEM server private key (with --tls-cert)", "tls_key_file"),
    Flag(
        "--tls-client-ca",
        "PEM CA of client certificates: require mTLS (clients without one are refused)",
        "tls_client_ca_file",
    ),
    Flag(
        "--health-plaintext",
        "keep the health port plaintext under TLS (Kubernetes gRPC probes cannot speak TLS)",
        "health_plaintext",
        kind="switch",
    ),
    Flag(
        "--auth-tokens-file",
        "`identity role token` lines; turns authentication on; re-read on change and on SIGHUP",
        "auth_tokens_file",
    ),
    Flag(
        "--mtls-role",
        "map a client certificate SAN or CN to a role: NAME=trainer|admin|peer (repeatable)",
        "mtls_roles",
        kind="list",
        metavar="NAME=ROLE",
        to_field=_mtls_roles,
    ),
    Flag(
        "--insecure-trusted-network",
        "every host that can reach --host is trusted: allow a non-loopback address without "
        "authentication, or bearer tokens without TLS (refused otherwise; docs/security.md)",
        "insecure_trusted_network",
        kind="switch",
    ),
    Flag("--peer-token-file", "token this replica sends to its --peer replicas", "peer_token_file"),
    Flag("--peer-ca", "PEM CA verifying peer replicas (default: the client CA)", "peer_ca_file"),
    Flag("--peer-tls-name", "name in the peers' certificates (peers are dialed by IP)", "peer_tls_name"),
    Flag("--no-reflection", "do not serve gRPC server reflection", "reflection", kind="off-switch"),
    Flag(
        "--reflection-open",
        "serve reflection without credentials when authentication is on",
        "reflection_open",
        kind="switch",
    ),
    Flag("--max-abort-ids", "request ids in one Abort", "max_abort_ids"),
    Flag("--max-metadata-bytes", "serialized Sample.metadata bytes", "max_metadata_bytes"),
    Flag("--max-stop-strings", "SamplingParams.stop entries", "max_stop_strings"),
    Flag("--max-stop-string-chars", "characters of one stop string", "max_stop_string_chars"),
    Flag(
        "--max-chat-template-kwargs-bytes",
        "serialized RenderRequest.chat_template_kwargs bytes",
        "max_chat_template_kwargs_bytes",
    ),
    Flag(
        "--max-prompt-chars",
        "characters of prompt text of one chat render (front-door turn, Render RPC), checked first",
        "max_prompt_chars",
    ),
    Flag(
        "--max-control-request-bytes",
        "serialized request bytes of any RPC but Generate, RolloutStep, Render (checked before decoding)",
        "max_control_request_bytes",
    ),
    Flag(
        "--auth-failure-rate",
        "failed authentications per second per peer address after the burst (then RESOURCE_EXHAUSTED)",
        "auth_failure_rate_per_s",
    ),
    Flag(
        "--auth-failure-burst",
        "failed authentications per peer address at once (0 = unlimited)",
        "auth_failure_burst",
    ),
    Flag(
        "--refusal-audit-rate",
        "audit lines of refused control RPCs per second after the burst (the rest are counted)",
        "refusal_audit_rate_per_s",
    ),
    Flag(
        "--refusal-audit-burst",
        "audit lines of refused control RPCs at once (0 = every one)",
        "refusal_audit_burst",
    ),
    Flag(
        "--max-in-flight-per-caller",
        "generations (running + queued) per authenticated caller; 0 = half of in-flight limit + queue",
        "max_in_flight_per_caller",
    ),
    Flag("--control-rate", "Abort/Pause/Resume per second per caller (0 = unlimited)", "control_rate_per_s"),
    Flag("--control-burst", "control RPC burst per caller", "control_burst"),
    # Weight updates (UpdateWeights; docs/engines.md "Weight updates").
    Flag(
        "--weights-path-prefix",
        "directory under which UpdateWeights may name checkpoints for the engines to load "
        "(repeatable; none given: checkpoint updates are refused)",
        "weights_path_prefixes",
        kind="list",
        type=_weights_prefix,
        metavar="DIR",
    ),
    Flag(
        "--weights-load-timeout",
        "seconds one engine may take to load a checkpoint in UpdateWeights",
        "weights_load_timeout_s",
    ),
    Flag(
        "--weights-lease-ttl",
        "seconds the fleet-wide weight-update lease outlives a replica that stopped renewing it "
        "(a replica killed mid-update blocks updates on the others this long)",
        "weights_lease_ttl_s",
    ),
    Flag("--port-file", "write {grpc, health, openai, metrics, engines} as JSON here once serving", type=str),
    Flag("--log-level", "debug adds one line per engine HTTP call", type=str, default="info"),
    Flag(
        "--log-format",
        "log line format: json (one JSON object a line), console (readable), auto (console when "
        "standard error is a terminal, json otherwise)",
        type=str,
        default="auto",
        choices=("auto", "json", "console"),
    ),
)

#: The sections of `serve --help` (title, flags): 77 flags in one list were hard to read. Every flag
#: of FLAGS and `--config` sit in exactly one (tests/ops/test_cli.py); a flag missing here is listed
#: under `UNGROUPED`, which that test refuses. The order within a section is that of FLAGS.
FLAG_GROUPS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("configuration", ("--config", "--port-file")),
    (
        "engines",
        (
            "--engine",
            "--engines-file",
            "--sim",
            "--sim-token-delay-ms",
            "--raw-logprobs",
            "--sglang-experts-topk",
            "--health-interval",
            "--breaker-cooldown",
            "--engine-connect-timeout",
            "--engine-read-timeout",
            "--engine-idle-timeout",
            "--max-engine-attempts",
            "--no-engine-stream-interval",
        ),
    ),
    (
        "network",
        (
            "--host",
            "--port",
            "--health-port",
            "--peer",
            "--max-receive-message-mb",
            "--max-send-message-mb",
            "--max-connection-age",
            "--max-connection-age-grace",
            "--keepalive-time",
            "--max-unrequested-time",
            "--max-pending-calls",
        ),
    ),
    (
        "TLS and authentication (docs/security.md)",
        (
            "--tls-cert",
            "--tls-key",
            "--tls-client-ca",
            "--health-plaintext",
            "--auth-tokens-file",
            "--mtls-role",
            "--insecure-trusted-network",
            "--peer-token-file",
            "--peer-ca",
            "--peer-tls-name",
            "--no-reflection",
            "--reflection-open",
            "--auth-failure-rate",
            "--auth-failure-burst",
            "--refusal-audit-rate",
            "--refusal-audit-burst",
        ),
    ),
    (
        "admission and control",
        (
            "--server-concurrency",
            "--rollout-num-gpus",
            "--rollout-num-gpus-per-engine",
            "--max-queue",
            "--retry-after",
            "--max-in-flight-per-caller",
            "--control-rate",
            "--control-burst",
            "--control-deadline",
        ),
    ),
    (
        "request bounds",
        (
            "--max-images",
            "--max-image-pixels",
            "--max-image-bytes",
            "--max-abort-ids",
            "--max-metadata-bytes",
            "--max-stop-strings",
            "--max-stop-string-chars",
            "--max-chat-template-kwargs-bytes",
            "--max-prompt-chars",
            "--max-control-request-bytes",
        ),
    ),
    (
        "streaming and deadlines",
        ("--deadline-margin", "--deadline-abort-lead", "--stream-batch-tokens", "--stream-batch-interval-ms"),
    ),
    (
        "RolloutStep and rewards (docs/rollout-step.md)",
        (
            "--reward-url",
            "--step-plugin",
            "--env-url",
            "--rule-reward-processes",
            "--rule-reward-timeout-s",
            "--rule-reward-memory-mb",
            "--step-buffer-mb-per-caller",
            "--step-buffer-mb",
            "--step-buffer-ttl-s",
        ),
    ),
    (
        "fleet state (docs/architecture.md)",
        ("--state-store", "--state-store-password-file", "--state-store-ca-file"),
    ),
    (
        "weight updates (docs/engines.md)",
        ("--weights-path-prefix", "--weights-load-timeout", "--weights-lease-ttl"),
    ),
    (
        "OpenAI front door (docs/agentic.md)",
        ("--openai-port", "--openai-tool-parser", "--openai-body-timeout", "--openai-drift-policy"),
    ),
    (
        "workers and shutdown (docs/workers.md)",
        ("--workers", "--worker-restarts", "--worker-restart-window", "--grace", "--abort-grace"),
    ),
    (
        "observability (docs/operations.md)",
        ("--metrics-port", "--metrics-engine-urls", "--otlp-endpoint", "--log-level", "--log-format"),
    ),
)
#: The `serve --help` section of a flag missing from FLAG_GROUPS (listed, never hidden).
UNGROUPED: Final = "other (not in settings.FLAG_GROUPS)"


_TYPES: Final[dict[str, Callable[[str], Any]]] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list[str]": str,
}


#: Nested dataclasses of ServerConfig whose fields are flags ("default_options.x", "openai.x").
_NESTED: Final[dict[str, type[Any]]] = {"default_options": GenerateOptions, "openai": FrontDoorConfig}


def _field(path: str) -> dataclasses.Field[Any]:
    owner: type[Any] = ServerConfig
    outer, dot, inner = path.partition(".")
    if dot:
        owner, path = _NESTED[outer], inner
    by_name = {f.name: f for f in dataclasses.fields(owner)}
    return by_name[path]


def _field_default(path: str) -> Any:
    f = _field(path)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


#: Numeric flags whose value must be at least 1: a count of 0 would leave the service unable to
#: work at all (no generation admitted, no engine attempt, no room in a message).
AT_LEAST_ONE: Final = frozenset(
    {
        "--workers",
        "--server-concurrency",
        "--rollout-num-gpus",
        "--rollout-num-gpus-per-engine",
        "--max-engine-attempts",
        "--stream-batch-tokens",
        "--max-receive-message-mb",
        "--max-send-message-mb",
        "--max-control-request-bytes",
    }
)
#: Numeric flags whose value must be above 0: deadlines, timeouts and intervals, where 0 would
#: expire at once or spin. (Rates and bursts take 0: their help says what it means.)
ABOVE_ZERO: Final = frozenset(
    {
        "--control-deadline",
        "--health-interval",
        "--engine-connect-timeout",
        "--engine-idle-timeout",
        "--keepalive-time",
        "--openai-body-timeout",
        "--max-unrequested-time",
        "--weights-load-timeout",
        "--weights-lease-ttl",
    }
)
#: Port flags: 0 (any free port) to 65535.
PORTS: Final = frozenset({"--port", "--health-port", "--metrics-port", "--openai-port"})


def _in_range(flag: Flag, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` (int or float) that also refuses what no flag means: NaN, infinities, negative
    values, and the flag's own bounds (`AT_LEAST_ONE`, `ABOVE_ZERO`, `PORTS`); argparse prefixes
    the message with the flag, `_convert` with the source."""
    return ranged_number(
        parse,
        low=1 if flag.name in AT_LEAST_ONE else 0,
        above=flag.name in ABOVE_ZERO,
        high=MAX_PORT if flag.name in PORTS else None,
    )


def _flag_type(flag: Flag) -> Callable[[str], Any]:
    if flag.type is not None:
        parse = flag.type
    else:
        annotation = str(_field(flag.field).type).replace(" | None", "")
        parse = _TYPES.get(annotation, str)  # an enum (DriftPolicy) is parsed as its value, then to_field
    return _in_range(flag, parse) if parse in (int, float) else parse


def flag_default(flag: Flag) -> Any:
    """The flag's default value, in the flag's unit."""
    if not flag.field:
        return [] if flag.kind == "list" else flag.default
    value = _field_default(flag.field)
    if flag.kind == "off-switch":
        return not value
    if flag.kind == "list":
        return list(value or []) if flag.to_field is None else []
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    return value * flag.scale if flag.scale != 1.0 else value


class _ListAction(argparse.Action):
    """Repeatable flag whose first use on the command line replaces a default from env or file."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        items = getattr(namespace, self.dest)
        items = [] if items is self.default or items is None else items
        setattr(namespace, self.dest, [*items, values])


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every flag of FLAGS (and --config) to `parser` in the sections of FLAG_GROUPS, defaults
    shown in --help."""
    sections = {title: parser.add_argument_group(title) for title, _ in FLAG_GROUPS}
    section_of = {name: sections[title] for title, names in FLAG_GROUPS for name in names}

    def section(name: str) -> argparse._ArgumentGroup:
        if name not in section_of:
            section_of[name] = sections.get(UNGROUPED) or parser.add_argument_group(UNGROUPED)
            sections[UNGROUPED] = section_of[name]
        return section_of[name]

    section("--config").add_argument(
        "--config",
        help=f"TOML file of flag values (keys are flag names); env {ENV_PREFIX}CONFIG",
        default=None,
    )
    for flag in FLAGS:
        group = section(flag.name)
        names = (flag.name, *flag.aliases)
        text = f"{flag.help} [env {flag.env}]"
        default = flag_default(flag)
        if flag.kind in ("switch", "off-switch"):
            group.add_argument(*names, dest=flag.dest, action="store_true", default=default, help=text)
        elif flag.kind == "list":
            group.add_argument(
                *names,
                dest=flag.dest,
                action=_ListAction,
                type=flag.type or str,
                default=default,
                metavar=flag.metavar,
                help=text,
            )
        else:
            group.add_argument(
                *names,
                dest=flag.dest,
                type=_flag_type(flag),
                default=default,
                choices=flag.choices,
                metavar=flag.metavar,
                help=text,
            )


def _convert(flag: Flag, raw: Any, source: str) -> Any:
    """A value from the environment (a string) or a TOML file (typed) in the flag's type."""
    try:
        if flag.kind in ("switch", "off-switch"):
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text not in _TRUE | _FALSE:
                raise ValueError(f"expected true or false, got {raw!r}")
            return text in _TRUE
        if flag.kind == "list":
            items = [str(v) for v in raw] if isinstance(raw, list) else str(raw).split(",")
            check = flag.type or str
            return [check(v.strip()) for v in items if v.strip()]
        if isinstance(raw, bool):
            raise ValueError(f"expected a {_flag_type(flag).__name__}, got {raw!r}")
        value = _flag_type(flag)(raw if isinstance(raw, str) else str(raw))
        if flag.choices and value not in flag.choices:
            raise ValueError(f"must be one of {', '.join(flag.choices)}, got {value!r}")
        return value
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise SettingsError(f"{source}: {flag.name}: {exc}") from exc


class SettingsError(ValueError):
    """A value from the environment or the config file is unusable; the message names it."""


_BY_KEY: Final[dict[str, Flag]] = {
    key: flag
    for flag in FLAGS
    for key in (flag.dest, *(a.removeprefix("--").replace("-", "_") for a in flag.aliases))
}


def from_config_file(path: str) -> dict[str, Any]:
    """Flag values (by argparse dest) from a TOML file."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"config file {path}: {exc}") from exc
    values: dict[str, Any] = {}
    for key, raw in data.items():
        flag = _BY_KEY.get(key.replace("-", "_"))
        if flag is None:
            close = difflib.get_close_matches(key.replace("-", "_"), sorted(_BY_KEY), n=1, cutoff=0.7)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SettingsError(
                f"config file {path}: unknown key {key!r} (keys are `serve` flag names){hint}"
            )
        values[flag.dest] = _convert(flag, raw, f"config file {path} key {key!r}")
    return values


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """Flag values (by argparse dest) from ROLLOUT_GRPC_* variables."""
    values: dict[str, Any] = {}
    for flag in FLAGS:
        if flag.env in environ:
            values[flag.dest] = _convert(flag, environ[flag.env], f"environment {flag.env}")
    return values


@dataclass(frozen=True, slots=True)
class UnknownVariable:
    """A ROLLOUT_GRPC_* environment variable that no setting reads, and the one it probably meant."""

    name: str
    #: The closest setting's variable and flag, when one is close enough to be a likely typo.
    meant: str | None = None
    flag: str | None = None

    def __str__(self) -> str:
        hint = ""
        if self.meant:
            hint = f"; did you mean {self.meant}" + (f" ({self.flag})?" if self.flag else "?")
        return f"environment variable {self.name} matches no setting and is ignored{hint}"


def unknown_variables(environ: Mapping[str, str]) -> list[UnknownVariable]:
    """The ROLLOUT_GRPC_* variables of `environ` that nothing reads: a misspelt setting would
    otherwise be silently ignored and the default used in its place."""
    by_env = {flag.env: flag for flag in FLAGS}
    known = set(by_env) | set(OTHER_VARIABLES)
    by_alias = {
        ENV_PREFIX + a.removeprefix("--").replace("-", "_").upper(): flag
        for flag in FLAGS
        for a in flag.aliases
    }
    unknown: list[UnknownVariable] = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name.startswith(OTHER_PREFIXES):
            continue
        # Compared without the shared prefix, which would make every name look close.
        suffixes = sorted(k.removeprefix(ENV_PREFIX) for k in known)
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), suffixes, n=1, cutoff=0.75)
        meant = ENV_PREFIX + close[0] if close else None
        if name in by_alias:  # flag aliases (--sim-engines) have no variables of their own
            meant = by_alias[name].env
        flag = by_env[meant].name if meant in by_env else None
        unknown.append(UnknownVariable(name, meant, flag))
    return unknown


def parse_serve_args(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse `serve` arguments with precedence flag > environment > config file > default."""
    env = os.environ if environ is None else environ
    # No prefix matching here either: `--conf x` must not be read as `--config x`.
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    config_path = known.config or env.get(ENV_PREFIX + "CONFIG")
    layered: dict[str, Any] = {}
    try:
        if config_path:
            layered.update(from_config_file(config_path))
        layered.update(from_environment(env))
    except SettingsError as exc:
        _fail(parser, str(exc))
    parser.set_defaults(**layered)
    # Errors as one line: argparse's own error() prints the whole usage first, 40 lines for `serve`,
    # above the one that says what is wrong.
    parser.exit_on_error = False
    try:
        args, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        _fail(parser, str(exc))
    if extra:
        _fail(parser, unrecognized_message(parser, extra))
    return args


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit 2 (argparse's code for bad usage) with one line on stderr and no traceback."""
    parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")


def read_engines_file(path: str) -> list[EngineURL]:
    """One engine URL per line; blank lines and # comments are ignored. A bad line is a
    SettingsError naming the file and the line number (the file is edited by hand, or by a
    ConfigMap, and re-read on SIGHUP)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"engines file {path}: {exc}") from exc
    engines: list[EngineURL] = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            engines.append(parse_engine_url(text))
        except ValueError as exc:
            raise SettingsError(f"engines file {path} line {number}: {exc}") from None
    return engines


def engine_list(args: argparse.Namespace) -> list[EngineURL]:
    """The engines of parsed `serve` settings: `--engine` values, then the engines file's lines."""
    engines = [parse_engine_url(text) for text in args.engine]
    if args.engines_file:
        engines += read_engines_file(args.engines_file)
    return engines


def engine_kinds(engines: list[EngineURL]) -> dict[str, str]:
    """URL -> kind of the engines that are not vLLM (`ServerConfig.engine_kinds`)."""
    return {e.url: e.kind.value for e in engines if e.kind is not EngineKind.VLLM}


def server_config(
    args: argparse.Namespace,
    engines: list[str],
    *,
    simulated: bool = False,
    kinds: dict[str, str] | None = None,
) -> ServerConfig:
    """The ServerConfig that the parsed flags describe (flags without a field are skipped);
    `kinds` maps the engine URLs that are not vLLM to their kind (`engine_kinds`)."""
    top: dict[str, Any] = {
        "engines": engines,
        "simulated_engines": simulated,
        "engine_kinds": dict(kinds or {}),
    }
    nested: dict[str, dict[str, Any]] = {name: {} for name in _NESTED}
    for flag in FLAGS:
        if not flag.field or flag.field == "engines":
            continue
        value = getattr(args, flag.dest)
        if flag.kind == "off-switch":
            value = not value
        elif flag.kind == "list":
            value = list(value)
            if flag.to_field is not None:
                value = flag.to_field(value)
        elif value is not None and flag.zero_is_none and value == 0:
            value = None
        elif value is not None and flag.scale != 1.0:
            value = value / flag.scale
        elif value is not None and flag.to_field is not None:
            value = flag.to_field(value)
        outer, dot, inner = flag.field.partition(".")
        if dot:
            nested[outer][inner] = value
        else:
            top[flag.field] = value
    return ServerConfig(**{name: _NESTED[name](**values) for name, values in nested.items()}, **top)
