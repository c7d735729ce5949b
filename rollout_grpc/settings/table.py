"""The `serve` flags: one `Flag` per setting, in the order of `--help`'s usage line, with the
argument types of the flags that check their values, the config fields that are deliberately
not flags (and why) and the flags of the command itself (which fill no field). A new setting is a
field of its section's sub-config in `server/config.py`, one row here and its name in that
section of `groups.FLAG_GROUPS` (docs/architecture.md "The config's shape").
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Final

from rollout_grpc.server.config import (
    TOOL_PARSERS,
    FrontDoorConfig,
    peer_problem,
    reward_url_problem,
)
from rollout_grpc.settings.engine_urls import _engine_argument
from rollout_grpc.settings.flag import Flag, SettingsError

#: ServerConfig fields that are deliberately not flags, and why.
NOT_FLAGS: Final[dict[str, str]] = {
    "default_options": "its server-wide fields are flags of their own (--stream-batch-*)",
    "simulated_engines": "set by --sim, never by hand",
    "engine_kinds": "read from the KIND+ prefix of each engine URL (--engine, --engines-file)",
    "openai": "a FrontDoorConfig, whose fields are flags of their own (--openai-*) or in NOT_OPENAI_FLAGS",
    "reuse_port": "set per worker by the `serve --workers` supervisor (the port it reserved)",
}

#: Flags of the `serve` command itself: they fill no config field (`Flag.field` ""), and why.
COMMAND_FLAGS: Final[dict[str, str]] = {
    "--engines-file": "read by the command into the engine list (`engines`), re-read on SIGHUP",
    "--sim": "the command starts N simulated engines, whose URLs become the engine list",
    "--sim-token-delay-ms": "a knob of the simulated engines the command starts, not of the replica",
    "--workers": "the command runs a supervisor and N worker processes instead of one replica",
    "--port-file": "written by the command once the replica serves",
    "--log-level": "the command configures logging before the replica exists",
    "--log-format": "the command configures logging before the replica exists",
}

#: FrontDoorConfig (`ServerConfig.openai`) fields that are not flags yet, and why.
NOT_OPENAI_FLAGS: Final[dict[str, str]] = {
    "return_routed_experts": "R3 per turn needs MoE engines started for it; set in code (docs/agentic.md)",
    "stream_batch_tokens": "the front door's own stream batching, measured in docs/benchmarks.agentic.md",
    "stream_batch_interval_s": "the front door's own stream batching, measured in docs/benchmarks.agentic.md",
}

#: The drift policies (`trajectory.DriftPolicy`), reached through the field's type.
_DRIFT_POLICY: Final = type(FrontDoorConfig().drift_policy)


def _mtls_roles(items: list[str]) -> dict[str, str]:
    """`NAME=ROLE` items as a dict; the role must be one of trainer, admin, peer."""
    roles: dict[str, str] = {}
    for item in items:
        name, sep, role = item.rpartition("=")
        if not sep or not name or role not in ("trainer", "admin", "peer"):
            raise SettingsError(f"--mtls-role: expected NAME=trainer|admin|peer, got {item!r}")
        roles[name] = role
    return roles


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
        "--step-drain-lease-ttl-s",
        "seconds a step's drain lease outlives a replica that stopped renewing it: a replica killed "
        "mid-step delays its caller's next continue step this long, then its held groups are "
        "reported lost; also how long a replica may lose the store before its step's lease expires",
        "step_drain_lease_ttl_s",
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
        "every worker serves the OpenAI front door, worker 0 the health port, the supervisor the merged "
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
        "--openai-max-sessions-per-caller",
        "live agent sessions one caller identity may hold in the state store (a new one beyond it "
        "is refused, never evicted); docs/agentic.md",
        "openai.max_sessions",
    ),
    Flag(
        "--openai-session-mb-per-caller",
        "MiB of recorded agent turns one caller identity may hold in the state store (a turn beyond "
        "it is refused); docs/agentic.md",
        "openai.max_session_mb",
    ),
    Flag(
        "--openai-session-ttl-s",
        "seconds an agent session is kept after its last turn (a collected id stays its owner's as long)",
        "openai.session_ttl_s",
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
