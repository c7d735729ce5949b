"""The replica's listening ports besides the gRPC one: health, the OpenAI front door, metrics.

Each is optional (its flag), each bind failure is `ports.PortUnavailable` naming the flag. They are
started by the wiring (`app.py`) after the gRPC server is built; this module only knows how to open
one of them, so the wiring reads as the list of what a replica runs.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from rollout_grpc.server import ports
from rollout_grpc.server.config import ServerConfig
from rollout_grpc.server.facade.door import RolloutFacade
from rollout_grpc.server.front.grpc.tls import server_credentials
from rollout_grpc.server.front.openai.server import OpenAIFrontDoor
from rollout_grpc.server.observe.metrics import Metrics, MetricsEndpoint
from rollout_grpc.server.ports import NO_REUSEPORT
from rollout_grpc.server.security.auth import AuthConfig
from rollout_grpc.server.security.tls import TlsConfig


def bind(
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


async def start_health_server(
    servicer: health.aio.HealthServicer, cfg: ServerConfig, tls: TlsConfig | None
) -> tuple[grpc.aio.Server, int]:
    """A separate health-only server (plaintext when asked, so kubelet probes need no cert) and its
    port."""
    # Health requests are one service name: anything larger is refused by gRPC core unread.
    server = grpc.aio.server(
        options=[
            NO_REUSEPORT,
            ("grpc.max_receive_message_length", cfg.request_limits().max_open_request_bytes),
        ]
    )
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    secure = tls is not None and not cfg.health_plaintext
    credentials = server_credentials(tls, require_client_cert=False) if secure and tls else None
    port = bind(server, cfg.host, cfg.health_port or 0, credentials, "health, --health-port")
    await server.start()
    return server, port


async def start_front_door(
    facade: RolloutFacade, cfg: ServerConfig, auth: AuthConfig, tls: TlsConfig | None, port: int
) -> tuple[OpenAIFrontDoor, int]:
    """The OpenAI-compatible front door on `port` (shared by the workers with SO_REUSEPORT when the
    replica runs several), and the port it listens on."""
    door = OpenAIFrontDoor(facade, cfg.openai, auth=auth, tls=tls, limits=cfg.request_limits())
    try:
        return door, await door.start(cfg.host, port, reuse_port=cfg.reuse_port)
    except OSError as exc:
        raise ports.unavailable("the OpenAI front door, --openai-port", cfg.host, port, exc) from None


async def start_metrics(metrics: Metrics, host: str, port: int) -> tuple[MetricsEndpoint, int]:
    """Prometheus `/metrics` on `port`, and the port it listens on."""
    endpoint = MetricsEndpoint(metrics)
    try:
        return endpoint, await endpoint.start(host, port)
    except OSError as exc:
        raise ports.unavailable("metrics, --metrics-port", host, port, exc) from None
