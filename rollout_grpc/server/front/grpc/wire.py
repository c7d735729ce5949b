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
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.security.limits import RequestLimits

#: A method's request deserializer (`FromString`, made tolerant by `decoding.py`).
Deserialize = Callable[[bytes], Any]


async def read_one(
    requests: AsyncIterator[bytes], deserialize: Deserialize, limits: RequestLimits, cap: str | None
) -> Any:
    """The call's one request message, decoded; InvalidArgument when it is missing or over `cap`
    (a `RequestLimits` field name; None: only the gRPC message limit applies)."""
    raw = await anext(requests, None)
    if raw is None:
        raise InvalidArgument("request", "the call ended before its request message")
    if cap is not None:
        limits.check_request_bytes(len(raw), cap)
    return deserialize(raw)
