"""The one place that maps domain errors to gRPC statuses (the per-call wrapper applies it).

Domain errors carry messages meant for the caller; INVALID_ARGUMENT also carries a
`google.rpc.BadRequest` field violation naming the field, RESOURCE_EXHAUSTED a `RetryInfo` and the
`grpc-retry-pushback-ms` trailer. Anything unexpected becomes INTERNAL with a generic message (the
exception is logged, never sent: its text could leak internals).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout_grpc.server.domain import errors


def to_status(exc: errors.RolloutError) -> grpc.Status:
    """The rich gRPC status for a domain error."""
    code = code_pb2.Code.Value(exc.code)
    details: list[any_pb2.Any] = []
    if isinstance(exc, errors.InvalidArgument):
        detail = any_pb2.Any()
        detail.Pack(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)
                ]
            )
        )
        details.append(detail)
    if isinstance(exc, errors.ResourceExhausted):
        detail = any_pb2.Any()
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(exc.retry_after_s * 1000))
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(detail)
    message = status_pb2.Status(code=code, message=exc.message, details=details)
    status: grpc.Status = rpc_status.to_status(message)
    if isinstance(exc, errors.ResourceExhausted):
        pushback = (("grpc-retry-pushback-ms", str(int(exc.retry_after_s * 1000))),)
        return _Status(status.code, status.details, tuple(status.trailing_metadata) + pushback)
    return status


class _Status(grpc.Status):
    """A status with extra trailing metadata (abort_with_status sends only the status' own)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, Any], ...]
    ) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata
