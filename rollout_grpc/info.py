"""`rollout-grpc info [--target host:port]`: a replica and its engines at a glance.

Calls GetServerInfo and the standard health service of one replica and prints a table (or, with
`--json`, GetServerInfo as JSON with the health status added). Exit code 0 when the replica is
SERVING, 1 when it answers but is not, 2 when it cannot be reached (or refuses the credentials).
The target defaults to the local replica (`127.0.0.1` and `serve`'s default port).

A replica with TLS or authentication (docs/security.md) is reached with the clients' options:
`--tls-ca` (or `--tls` for the system roots), `--tls-cert/--tls-key` for mTLS, `--token-file` for a
bearer token; each has an environment variable (`ROLLOUT_GRPC_INFO_TLS_CA`, ...,
`ROLLOUT_GRPC_INFO_TOKEN` holding the token itself). Engine URLs are shown to admins only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf import json_format, wrappers_pb2

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.argtypes import number
from rollout_grpc.client.channel import check_target
from rollout_grpc.client.credentials import ClientSecurity
from rollout_grpc.client.stubs import sync_stub

ENV_PREFIX = "ROLLOUT_GRPC_INFO_"

#: `rollout-grpc info --help`'s description.
DESCRIPTION = (
    "Show one replica and its engines: GetServerInfo and the health status, as a table or (--json) "
    "as JSON. Exit code 0 when the replica is SERVING, 1 when it answers but is not, 2 when it "
    "cannot be reached or refuses the credentials. TLS and token flags as the clients' (docs/security.md)."
)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name

#: The standard health service's Check method (grpc/health/v1/health.proto).
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
#: HealthCheckResponse.ServingStatus by number.
SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _health(channel: grpc.Channel, timeout: float) -> str:
    """The ServingStatus name of the rollout service from the standard health service.

    Without grpcio-health-checking's classes: that package is a server dependency, and `info` runs
    in the client-only install (tests/client/test_cli.py). The two health messages have the wire
    format of protobuf's own wrappers: HealthCheckRequest is `string service = 1` (StringValue),
    HealthCheckResponse is `ServingStatus status = 1`, an enum, encoded as an int32 (Int32Value)."""
    check = channel.unary_unary(
        HEALTH_CHECK,
        request_serializer=wrappers_pb2.StringValue.SerializeToString,
        response_deserializer=wrappers_pb2.Int32Value.FromString,
    )
    try:
        reply = check(wrappers_pb2.StringValue(value=SERVICE_NAME), timeout=timeout)
    except grpc.RpcError as exc:
        return f"unknown ({exc.code().name})"
    return SERVING_STATUS.get(reply.value, f"status {reply.value}")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def render(info: pb.GetServerInfoResponse, health: str, target: str) -> str:
    """The human-readable report of one replica."""
    lines = [
        f"replica {target}  version {info.version or '?'}  health {health}",
        f"in flight {info.in_flight}  queued {info.queued}  paused {_yes(info.paused)}  "
        f"weight version {info.weight_version or '(engines disagree or unknown)'}",
    ]
    if info.simulated_engines:
        lines.append("SIMULATED ENGINES: toy tokens, not a model (started with --sim)")
    lines.append("")
    header = [
        "engine",
        "kind",
        "usable",
        "healthy",
        "paused",
        "draining",
        "weight version",
        "in flight",
        "model",
    ]
    rows = [header]
    for e in info.engines:
        rows.append(
            [
                e.url,
                e.kind or "-",
                _yes(e.usable),
                _yes(e.healthy),
                _yes(e.paused),
                _yes(e.draining),
                e.weight_version or "-",
                str(e.in_flight),
                e.model or "-",
            ]
        )
    lines += _table(rows) if info.engines else ["(no engines)"]
    for e in info.engines:
        caps = e.capabilities if e.HasField("capabilities") else None
        if caps is not None:
            facts = [
                f"logprobs_mode={caps.logprobs_mode or '?'}",
                f"max_model_len={caps.max_model_len or '?'}",
                f"moe={_opt(caps, 'moe')}",
                f"routed_experts={_opt(caps, 'routed_experts')}",
                f"scale_out={_opt(caps, 'scale_out')}",
                f"dev_mode={_opt(caps, 'dev_mode')}",
            ]
            lines.append(f"\n{e.url}: {' '.join(facts)}")
        if e.health_error:
            lines.append(f"  UNHEALTHY  {e.url}: {e.health_error}")
        for problem in e.problems:
            lines.append(f"  PROBLEM  {problem}")
        for warning in e.warnings:
            lines.append(f"  warning  {warning}")
    return "\n".join(lines)


def _opt(caps: pb.EngineCapabilities, name: str) -> str:
    return _yes(bool(getattr(caps, name))) if caps.HasField(name) else "?"  # type: ignore[arg-type]


def add_arguments(parser: argparse.ArgumentParser, default_target: str) -> None:
    """The `info` flags; the connection flags default to their `ROLLOUT_GRPC_INFO_*` variables.

    `default_target` is the local replica (`serve`'s default port), so that `rollout-grpc info`
    on a replica's host needs no flag."""
    env = os.environ.get
    parser.add_argument(
        "--target",
        default=env(ENV_PREFIX + "TARGET", default_target),
        help=f"replica address host:port [{ENV_PREFIX}TARGET]",
    )
    parser.add_argument("--json", action="store_true", help="print GetServerInfo as JSON instead")
    parser.add_argument(
        "--timeout", type=number(float, above=True), default=10.0, help="seconds to wait for the answer"
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        default=env(ENV_PREFIX + "TLS", "") not in ("", "0", "false"),
        help=f"use TLS, verifying the replica with the system roots (implied by --tls-ca) [{ENV_PREFIX}TLS]",
    )
    parser.add_argument(
        "--tls-ca",
        default=env(ENV_PREFIX + "TLS_CA"),
        help=f"PEM CA that signed the replica's certificate [{ENV_PREFIX}TLS_CA]",
    )
    parser.add_argument(
        "--tls-cert",
        default=env(ENV_PREFIX + "TLS_CERT"),
        help=f"PEM client certificate for mTLS, with --tls-key [{ENV_PREFIX}TLS_CERT]",
    )
    parser.add_argument(
        "--tls-key", default=env(ENV_PREFIX + "TLS_KEY"), help=f"PEM client key [{ENV_PREFIX}TLS_KEY]"
    )
    parser.add_argument(
        "--tls-server-name",
        default=env(ENV_PREFIX + "TLS_SERVER_NAME"),
        help=f"name the replica's certificate is checked against when dialing an IP "
        f"[{ENV_PREFIX}TLS_SERVER_NAME]",
    )
    parser.add_argument(
        "--token-file",
        default=env(ENV_PREFIX + "TOKEN_FILE"),
        help=f"file holding the bearer token [{ENV_PREFIX}TOKEN_FILE; or the token itself in "
        f"{ENV_PREFIX}TOKEN]",
    )


def security_from_args(args: argparse.Namespace) -> ClientSecurity:
    """The client security settings of parsed `info` flags (the token file read here)."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together (mTLS)")
    token = os.environ.get(ENV_PREFIX + "TOKEN") or None
    if args.token_file:
        token = Path(args.token_file).read_text().strip() or None
        if token is None:
            raise ValueError(f"--token-file {args.token_file}: the file is empty")
    return ClientSecurity(
        tls=args.tls,
        root_certificates=args.tls_ca,
        certificate_chain=args.tls_cert,
        private_key=args.tls_key,
        token=token,
        server_name=args.tls_server_name,
    )


def _channel(target: str, security: ClientSecurity) -> grpc.Channel:
    credentials = security.channel_credentials()
    options = security.channel_options()
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def fetch(
    target: str, timeout: float, security: ClientSecurity | None = None
) -> tuple[pb.GetServerInfoResponse, str]:
    """GetServerInfo and the health status of the rollout service on `target`."""
    security = security or ClientSecurity()
    metadata = security.metadata()
    with _channel(check_target(target), security) as channel:
        # The client's stub, not the generated one: that passes `_registered_method`, which the
        # oldest grpcio the client supports (1.62) refuses.
        info = sync_stub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout, metadata=metadata)
        health = _health(channel, timeout)
    return info, health


def _as_dict(info: pb.GetServerInfoResponse) -> dict[str, Any]:
    """GetServerInfo as JSON, fields at their defaults included. protobuf renamed the option in 26.0
    (5.26 in Python), and the client supports protobuf 4.21 and later (pyproject.toml)."""
    try:
        return json_format.MessageToDict(info, always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf before 5.26
        old: dict[str, Any] = json_format.MessageToDict(info, including_default_value_fields=True)  # type: ignore[call-arg]
        return old


def _hint(exc: grpc.RpcError) -> str:
    """What a failure says about the port that was asked (the usual mistake: another port of the
    replica, its health, metrics or OpenAI port, or an engine's)."""
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        what = "a gRPC server without RolloutService answers here: the replica's health port?"
    elif "http1.x server" in details or "HTTP/1" in details:
        what = "an HTTP/1 server answers here: an engine, or the replica's metrics or OpenAI port?"
    else:
        return ""
    return f" ({what} ask its --port)"


def run_info(
    target: str,
    *,
    as_json: bool = False,
    timeout: float = 10.0,
    out: TextIO | None = None,
    security: ClientSecurity | None = None,
) -> int:
    """The `info` command; returns the exit code."""
    out = out or sys.stdout
    try:
        info, health = fetch(target, timeout, security)
    except grpc.RpcError as exc:
        hint = _hint(exc)
        print(f"rollout-grpc info: {target}: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # an unreadable certificate, key or token file
        print(f"rollout-grpc info: {exc}", file=sys.stderr)
        return 2
    code = 0 if health == "SERVING" else 1
    if as_json:
        body = _as_dict(info)
        text = json.dumps(body | {"health": health}, indent=2)
    else:
        text = render(info, health, target)
    try:
        print(text, file=out)
        out.flush()
    except BrokenPipeError:
        # The reader left early (`info --json | head -1`): that is its choice, not an error. Point
        # stdout at /dev/null so that the interpreter's own flush at exit does not raise again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    return code
