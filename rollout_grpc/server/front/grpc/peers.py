"""Forwarding aborts to the other replicas (`rollout.v1.ReplicaService/AbortLocal`).

Abort-all and an admin's abort-by-id reach every replica's generations through the shared engines.
A session or group abort cannot: only the replica serving a generation knows its session and
group; nor can a trainer's abort-by-id, which must reach only that trainer's generations. With
`--peer` configured, the receiving replica forwards such aborts to its peers through the internal
`ReplicaService.AbortLocal` (never forwarded again), carrying the caller's identity as the owner,
and adds up what they aborted. The call authenticates like any other: the replica's TLS channel
credentials and, with tokens, its `peer` token.

A peer is either a fixed `host:port` or `dns:///name:port`. The DNS form is resolved at every abort
to all of its addresses (a Kubernetes headless Service lists every ready pod), so replicas that
come and go are reached without configuration; this replica's own addresses are skipped.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Sequence
from typing import cast

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server.config import DNS_PREFIX
from rollout_grpc.server.facade.values import AbortScope, ForwardedAbort
from rollout_grpc.server.front.grpc.replica import abort_request

log = structlog.get_logger(__name__)


def _own_addresses() -> set[str]:
    """IP addresses of this host (to skip ourselves among resolved peers)."""
    addresses = {"127.0.0.1", "::1"}
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            addresses.add(str(info[4][0]))
    except OSError:
        pass
    return addresses


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


class PeerAborter:
    """gRPC channels to the peer replicas, opened on first use and kept.

    `timeout_s` bounds name resolution and each peer's Abort (the replica passes its control
    deadline), so a hung peer delays a session or group abort by at most that much.
    """

    def __init__(
        self,
        peers: list[str],
        own_port: int = 0,
        timeout_s: float = 10.0,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        tls_server_name: str | None = None,
    ) -> None:
        self._peers = peers
        self._own_port = own_port
        self._timeout_s = timeout_s
        self._credentials = credentials
        self._metadata = tuple(metadata)
        # Peers resolved from DNS are dialed by pod IP, which their certificates rarely name: the
        # name to verify instead (e.g. the headless Service's DNS name in the certificate).
        self._options: list[tuple[str, str]] = (
            [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
        )
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._own = _own_addresses()

    def set_own_port(self, port: int) -> None:
        """The port this replica listens on (known only once it is bound)."""
        self._own_port = port

    async def _targets(self) -> list[str]:
        """Peer addresses for this abort: fixed ones as given, DNS names resolved now."""
        targets: list[str] = []
        loop = asyncio.get_running_loop()
        for peer in self._peers:
            if not peer.startswith(DNS_PREFIX):
                targets.append(peer)
                continue
            host, port = _split(peer.removeprefix(DNS_PREFIX))
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), self._timeout_s
                )
            except (OSError, TimeoutError) as exc:
                log.warning("peer_resolve_failed", peer=peer, error=str(exc))
                continue
            for info in infos:
                address = str(info[4][0])
                if address in self._own and port == self._own_port:
                    continue
                targets.append(f"[{address}]:{port}" if ":" in address else f"{address}:{port}")
        return sorted(set(targets))

    def _stub(self, target: str) -> pb_grpc.ReplicaServiceStub:
        channel = self._channels.get(target)
        if channel is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(target, self._credentials, options=self._options)
            else:
                channel = grpc.aio.insecure_channel(target)
            self._channels[target] = channel
        return pb_grpc.ReplicaServiceStub(channel)

    async def abort(self, scope: AbortScope, *, within_replica: bool = False) -> ForwardedAbort:
        """Ask every peer to abort its local generations in `scope`: how many they ended, and which
        of the asked ids they had in flight (a `Fanout`, rollout/fanout.py).

        Not for Abort(all) (the shared engines' pause ends every replica's streams), nor for a
        peer's forward being relayed (`within_replica`: it is never forwarded again)."""
        if within_replica or scope.everything:
            return ForwardedAbort()
        request = abort_request(scope)
        targets = await self._targets()
        # The generated stub is typed for both sync and aio channels; on an aio channel it awaits.
        calls = [
            cast(
                Awaitable[pb.AbortLocalResponse],
                self._stub(t).AbortLocal(request, timeout=self._timeout_s, metadata=self._metadata),
            )
            for t in targets
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        outcome = ForwardedAbort()
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("peer_abort_failed", peer=target, error=str(result))
            else:
                outcome.aborted += result.aborted
                outcome.found_request_ids.update(result.found_request_ids)
        return outcome

    async def paused(self, mode: str) -> int:
        """Nothing for the peers: a Pause acts on the shared engines, whichever replica ran it."""
        return 0

    async def resumed(
        self, weight_version: str | None, relabelled: list[str], rotation: dict[str, str] | None = None
    ) -> None:
        """Nothing for the peers (each replica reads the engines' weight version itself)."""

    async def close(self) -> None:
        """Close the channels."""
        await asyncio.gather(*(c.close() for c in self._channels.values()))
