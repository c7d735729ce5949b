"""What a caller of worker 1 gets when worker 0's SiblingTrajectory fails (`forwarded_status`)."""

from __future__ import annotations

import grpc
from grpc.aio import AioRpcError, Metadata

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.front.grpc.status import to_status
from rollout_grpc.server.workers.control import forwarded_status


def _failed(code: grpc.StatusCode, details: str, trailers: Metadata | None = None) -> AioRpcError:
    return AioRpcError(code, Metadata(), trailers or Metadata(), details=details)


def test_worker_0s_own_answer_passes_with_its_rich_status() -> None:
    status = to_status(InvalidArgument("session_id", "too long"))
    trailers = Metadata(*status.trailing_metadata, ("x-internal", "dropped"))
    code, details, forwarded = forwarded_status(_failed(status.code, status.details, trailers))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, status.details)
    assert forwarded == tuple(status.trailing_metadata)  # the field violation, nothing else


def test_a_not_found_passes_as_it_is() -> None:
    failed = _failed(grpc.StatusCode.NOT_FOUND, "session 'x' is not recorded on this replica")
    assert forwarded_status(failed) == (grpc.StatusCode.NOT_FOUND, failed.details(), ())


def test_an_unreachable_worker_0_is_unavailable_without_grpcs_transport_text() -> None:
    failed = _failed(
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: unix:/tmp/rollout-w/0.sock",
    )
    code, details, trailers = forwarded_status(failed)
    assert code == grpc.StatusCode.UNAVAILABLE and trailers == ()
    assert "worker 0" in details and "unix:" not in details and "/tmp" not in details
