"""Request bytes are read off the wire only after the caller is admitted, and capped before decoding.

grpc.aio hands a unary-request handler its request already read and deserialized, before any
handler or interceptor code runs: an unauthenticated 63 MiB Abort was decoded whole (a replica's
peak RSS went from 72 MB to 896 MB, four at once past 1.8 GB of a 2 GiB pod limit) before it
was refused UNAUTHENTICATED. So the per-call wrapper registers every unary-request method at the
wire level as a request-streaming handler with no request deserializer (`as_wire_handler`): the
wrapper then runs when the call's metadata arrives, authenticates from it, and only then reads
the one request message as bytes (`read_one`), checks its size against the method's cap, and
decodes it with the method's own (tolerant, `decoding.py`) deserializer (`RpcInterceptor`). The
servicer still sees a decoded request, and clients see no difference: the wire format of a unary
request is one message either way.

An unread request is never pulled from the transport: gRPC core reads a stream's data only as
far as its flow-control window while no message is asked for, and the refusal resets the stream.

The services open to everyone get the same treatment without authentication: health requests
(one service name) are capped at `max_open_request_bytes` (`open_service`), and each message of
server reflection, open with `--reflection-open`, at `max_control_request_bytes` (`reflection`).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.front.grpc import status
from rollout_grpc.server.front.grpc.decoding import Undecodable, tolerant
from rollout_grpc.server.security.limits import RequestLimits

Context = grpc.aio.ServicerContext[Any, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # not subscriptable at run time

#: A method's request deserializer (`FromString`, made tolerant by `decoding.py`).
Deserialize = Callable[[bytes], Any]


async def read_one(context: Context, deserialize: Deserialize, limits: RequestLimits, cap: str | None) -> Any:
    """The call's one request message, decoded; InvalidArgument when it is missing or over `cap`
    (a `RequestLimits` field name; None: only the gRPC message limit applies).

    Read with `context.read()`, not from the handler's request iterator: that iterator is an async
    generator left suspended after the one message, and its finalizer then costs every call a
    thread-safe callback and a task to close it (bench/profile_notes.md, third pass)."""
    raw = await context.read()
    if raw is grpc.aio.EOF:
        raise InvalidArgument("request", "the call ended before its request message")
    if cap is not None:
        limits.check_request_bytes(len(raw), cap)
    return deserialize(raw)


def undecoded(raw: bytes) -> bytes:
    """The deserializer of a method registered without one: the bytes as they are."""
    return raw


def open_service(handler: Handler, limits: RequestLimits) -> Handler:
    """A unary-request handler of an open service (health) in wire form: its request read under
    `max_open_request_bytes` and decoded tolerantly, no authentication."""
    deserialize = tolerant(handler.request_deserializer or undecoded)

    async def read(context: Context) -> Any:
        try:
            request = await read_one(context, deserialize, limits, "max_open_request_bytes")
            if isinstance(request, Undecodable):
                raise InvalidArgument(
                    "request", f"the bytes are not a valid {request.message_type}: {request.error}"
                )
        except InvalidArgument as exc:
            await context.abort_with_status(status.to_status(exc))
        return request

    if handler.unary_unary is not None:
        check: Any = handler.unary_unary

        async def unary(requests: AsyncIterator[bytes], context: Context) -> Any:
            return await check(await read(context), context)

        return grpc.stream_unary_rpc_method_handler(unary, None, handler.response_serializer)
    if handler.unary_stream is not None:
        watch: Any = handler.unary_stream

        async def stream(requests: AsyncIterator[bytes], context: Context) -> None:
            out = watch(await read(context), context)
            if inspect.isasyncgen(out):  # a generator servicer; health's Watch writes itself
                async for message in out:
                    await context.write(message)
            else:
                await out

        return grpc.stream_stream_rpc_method_handler(stream, None, handler.response_serializer)
    return handler


def reflection(
    handler: Handler, limits: RequestLimits, admit: Callable[[Context], Awaitable[None]] | None
) -> Handler:
    """Server reflection (a bidirectional stream) in wire form: `admit` (authentication, when
    reflection is not open) runs before any message is read; each message is capped at
    `max_control_request_bytes` before it is decoded."""
    inner: Any = handler.stream_stream
    deserialize = handler.request_deserializer or undecoded

    async def stream_stream(raw: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
        if admit is not None:
            await admit(context)

        async def requests() -> AsyncIterator[Any]:
            async for message in raw:
                try:
                    limits.check_request_bytes(len(message), "max_control_request_bytes")
                except InvalidArgument as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
                yield deserialize(message)

        async for response in inner(requests(), context):
            yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, None, handler.response_serializer)
