"""The `serve` command's settings: one source of defaults, three sources of values.

Defaults live in ONE place, the dataclasses `ServerConfig` (`server/app.py`) and `GenerateOptions`
(`server/domain.py`); the command-line flags are derived from their fields through the `FLAGS`
table below, which adds only a flag name, a help text and a unit. `tests/unit/test_settings.py`
checks that every `ServerConfig` field is a flag or is listed in `NOT_FLAGS`.

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
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rollout_grpc.server.app import ServerConfig
from rollout_grpc.server.domain.model import GenerateOptions

ENV_PREFIX: Final = "ROLLOUT_GRPC_"

#: ServerConfig fields that are deliberately not flags, and why.
NOT_FLAGS: Final[dict[str, str]] = {
    "default_options": "its server-wide fields are flags of their own (--stream-batch-*)",
    "simulated_engines": "set by --sim, never by hand",
    "openai": "the front door's policies (drift, tool parser, session cap) are set in code; docs/agentic.md",
}

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag.

    `field` names the `ServerConfig` field it sets ("default_options.x" for a `GenerateOptions`
    field; "" for a flag of the command itself, whose default is `default`). A flag's value is
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


FLAGS: Final[tuple[Flag, ...]] = (
    Flag("--engine", "vLLM base URL (repeatable)", "engines", kind="list"),
    Flag(
        "--reward-url",
        "URL prefix a RolloutStep's remote reward may use (repeatable; none given: any URL)",
        "reward_urls",
        kind="list",
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
    Flag("--sim-token-delay-ms", "per-token delay of the simulated engines", type=float, default=0.0),
    Flag("--host", "address to bind the gRPC (and health and metrics) ports to", "host"),
    Flag("--port", "gRPC port (0 = any free port)", "port"),
    Flag("--health-port", "separate grpc.health.v1 port (0 = any free port)", "health_port"),
    Flag("--metrics-port", "Prometheus /metrics HTTP port (0 = any free port; unset = off)", "metrics_port"),
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
        "--max-engine-attempts", "engine calls per Generate (the first plus failovers)", "max_engine_attempts"
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
        "--openai-port",
        "serve the OpenAI-compatible agent front door on this port (0 = any free port; unset = off)",
        "openai_port",
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
        "--max-in-flight-per-caller",
        "generations (running + queued) per authenticated caller; 0 = half of in-flight limit + queue",
        "max_in_flight_per_caller",
    ),
    Flag("--control-rate", "Abort/Pause/Resume per second per caller (0 = unlimited)", "control_rate_per_s"),
    Flag("--control-burst", "control RPC burst per caller", "control_burst"),
    Flag("--port-file", "write {grpc, health, openai, metrics, engines} as JSON here once serving", type=str),
    Flag("--log-level", "debug adds one line per engine HTTP call", type=str, default="info"),
    Flag("--log-format", "log line format", type=str, default="json", choices=("json", "console")),
)

_TYPES: Final[dict[str, Callable[[str], Any]]] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list[str]": str,
}


def _field(path: str) -> dataclasses.Field[Any]:
    owner: type[Any] = ServerConfig
    if path.startswith("default_options."):
        owner, path = GenerateOptions, path.removeprefix("default_options.")
    by_name = {f.name: f for f in dataclasses.fields(owner)}
    return by_name[path]


def _field_default(path: str) -> Any:
    f = _field(path)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _flag_type(flag: Flag) -> Callable[[str], Any]:
    if flag.type is not None:
        return flag.type
    annotation = str(_field(flag.field).type).replace(" | None", "")
    return _TYPES[annotation]


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
    """Add every flag of FLAGS (and --config) to `parser`, defaults shown in --help."""
    parser.add_argument(
        "--config",
        help=f"TOML file of flag values (keys are flag names); env {ENV_PREFIX}CONFIG",
        default=None,
    )
    for flag in FLAGS:
        names = (flag.name, *flag.aliases)
        text = f"{flag.help} [env {flag.env}]"
        default = flag_default(flag)
        if flag.kind in ("switch", "off-switch"):
            parser.add_argument(*names, dest=flag.dest, action="store_true", default=default, help=text)
        elif flag.kind == "list":
            parser.add_argument(
                *names, dest=flag.dest, action=_ListAction, default=default, metavar=flag.metavar, help=text
            )
        else:
            parser.add_argument(
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
            if isinstance(raw, list):
                return [str(v) for v in raw]
            return [v.strip() for v in str(raw).split(",") if v.strip()]
        if isinstance(raw, bool):
            raise ValueError(f"expected a {_flag_type(flag).__name__}, got {raw!r}")
        value = _flag_type(flag)(raw if isinstance(raw, str) else str(raw))
        if flag.choices and value not in flag.choices:
            raise ValueError(f"must be one of {', '.join(flag.choices)}, got {value!r}")
        return value
    except (TypeError, ValueError) as exc:
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
            raise SettingsError(f"config file {path}: unknown key {key!r} (keys are `serve` flag names)")
        values[flag.dest] = _convert(flag, raw, f"config file {path}")
    return values


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """Flag values (by argparse dest) from ROLLOUT_GRPC_* variables."""
    values: dict[str, Any] = {}
    for flag in FLAGS:
        if flag.env in environ:
            values[flag.dest] = _convert(flag, environ[flag.env], f"environment {flag.env}")
    return values


def parse_serve_args(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse `serve` arguments with precedence flag > environment > config file > default."""
    env = os.environ if environ is None else environ
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    config_path = known.config or env.get(ENV_PREFIX + "CONFIG")
    layered: dict[str, Any] = {}
    try:
        if config_path:
            layered.update(from_config_file(config_path))
        layered.update(from_environment(env))
    except SettingsError as exc:
        parser.error(str(exc))
    parser.set_defaults(**layered)
    return parser.parse_args(argv)


def server_config(args: argparse.Namespace, engines: list[str], *, simulated: bool = False) -> ServerConfig:
    """The ServerConfig that the parsed flags describe (flags without a field are skipped)."""
    top: dict[str, Any] = {"engines": engines, "simulated_engines": simulated}
    options: dict[str, Any] = {}
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
        if flag.field.startswith("default_options."):
            options[flag.field.removeprefix("default_options.")] = value
        else:
            top[flag.field] = value
    return ServerConfig(default_options=GenerateOptions(**options), **top)
