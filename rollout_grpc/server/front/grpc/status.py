"""The one place that maps exceptions to gRPC status codes.

Domain errors carry messages meant for the caller; INVALID_ARGUMENT also carries a
`google.rpc.BadRequest` field violation naming the field, RESOURCE_EXHAUSTED a `RetryInfo` and the
`grpc-retry-pushback-ms` trailer. Anything unexpected becomes INTERNAL with a generic message (the
exception is logged, never sent: its text could leak internals).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout_grpc.server.domain import errors
from rollout_grpc.server.front.grpc.decoding import Undecodable

log = structlog.get_logger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")

_CODES: list[tuple[type[errors.RolloutError], grpc.StatusCode, int]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, code_pb2.FAILED_PRECONDITION),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND, code_pb2.NOT_FOUND),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE, code_pb2.UNAVAILABLE),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, code_pb2.RESOURCE_EXHAUSTED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, code_pb2.PERMISSION_DENIED),
]


def to_status(exc: errors.RolloutError) -> grpc.Status:
    """The rich gRPC status for a domain error."""
    code = next(c for cls, _, c in _CODES if isinstance(exc, cls))
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


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> None:
    if isinstance(exc, errors.RolloutError):
        await context.abort_with_status(to_status(exc))
    log.exception("internal_error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by the server)")


def _check_decoded(request: object) -> None:
    """A request whose bytes did not parse (see decoding.py) is the caller's error."""
    if isinstance(request, Undecodable):
        raise errors.InvalidArgument(
            "request", f"the bytes are not a valid {request.message_type}: {request.error}"
        )


def unary(
    handler: Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]]:
    """Map exceptions of a unary handler to status codes."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext[Req, Resp]) -> Resp:
        try:
            _check_decoded(request)
            return await handler(self, request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)
            raise  # unreachable: abort raises

    return wrapper


def streaming(
    handler: Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], AsyncIterator[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], AsyncIterator[Resp]]:
    """Map exceptions of a server-streaming handler to status codes."""

    @functools.wraps(handler)
    async def wrapper(
        self: Any, request: Req, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> AsyncIterator[Resp]:
        try:
            _check_decoded(request)
            async for message in handler(self, request, context):
                yield message
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return wrapper
