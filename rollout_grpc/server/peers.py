"""Forwarding session/group aborts to the other replicas.

Abort-all and abort-by-id reach every replica's generations through the shared engines. A session
or group abort cannot: only the replica serving a generation knows its session and group. With
`--peer` addresses configured, the receiving replica forwards such aborts to its peers with
`local_only` set (so they do not forward again) and adds up what they aborted.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)


class PeerAborter:
    """gRPC channels to the peer replicas."""

    def __init__(self, addresses: list[str], timeout_s: float = 10.0) -> None:
        self._channels = [grpc.aio.insecure_channel(a) for a in addresses]
        self._stubs = [pb_grpc.RolloutServiceStub(c) for c in self._channels]
        self._addresses = addresses
        self._timeout_s = timeout_s

    async def abort(self, session_id: str | None, group_index: int | None) -> int:
        """Ask every peer to abort its local generations of the session or group."""
        if session_id is not None:
            request = pb.AbortRequest(session_id=session_id, local_only=True)
        else:
            request = pb.AbortRequest(group_index=group_index or 0, local_only=True)
        results = await asyncio.gather(
            *(stub.Abort(request, timeout=self._timeout_s) for stub in self._stubs), return_exceptions=True
        )
        aborted = 0
        for address, result in zip(self._addresses, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("peer_abort_failed", peer=address, error=str(result))
            else:
                aborted += result.aborted
        return aborted

    async def close(self) -> None:
        """Close the channels."""
        await asyncio.gather(*(c.close() for c in self._channels))
