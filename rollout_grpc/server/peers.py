"""Forwarding session/group aborts to the other replicas.

Abort-all and abort-by-id reach every replica's generations through the shared engines. A session
or group abort cannot: only the replica serving a generation knows its session and group. With
`--peer` configured, the receiving replica forwards such aborts to its peers with `local_only` set
(so they do not forward again) and adds up what they aborted.

A peer is either a fixed `host:port` or `dns:///name:port`. The DNS form is resolved at every abort
to all of its addresses (a Kubernetes headless Service lists every ready pod), so replicas that
come and go are reached without configuration; this replica's own addresses are skipped.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable
from typing import cast

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

DNS_PREFIX = "dns:///"


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

    def __init__(self, peers: list[str], own_port: int = 0, timeout_s: float = 10.0) -> None:
        self._peers = peers
        self._own_port = own_port
        self._timeout_s = timeout_s
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

    def _stub(self, target: str) -> pb_grpc.RolloutServiceStub:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = grpc.aio.insecure_channel(target)
        return pb_grpc.RolloutServiceStub(channel)

    async def abort(self, session_id: str | None, group_index: int | None) -> int:
        """Ask every peer to abort its local generations of the session or group."""
        if session_id is not None:
            request = pb.AbortRequest(session_id=session_id, local_only=True)
        else:
            request = pb.AbortRequest(group_index=group_index or 0, local_only=True)
        targets = await self._targets()
        # The generated stub is typed for both sync and aio channels; on an aio channel it awaits.
        calls = [
            cast(Awaitable[pb.AbortResponse], self._stub(t).Abort(request, timeout=self._timeout_s))
            for t in targets
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        aborted = 0
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("peer_abort_failed", peer=target, error=str(result))
            else:
                aborted += result.aborted
        return aborted

    async def close(self) -> None:
        """Close the channels."""
        await asyncio.gather(*(c.close() for c in self._channels.values()))
