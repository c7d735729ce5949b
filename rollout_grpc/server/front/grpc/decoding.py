"""Request bytes that are not a valid message become INVALID_ARGUMENT, never UNKNOWN.

grpc.aio deserializes a request before any handler or interceptor runs, and reports a deserializer
exception as UNKNOWN with the Python exception in the message ("Unexpected <class
'google.protobuf.message.DecodeError'>..."). Protobuf raises `DecodeError` for bytes a caller can
send: fields nested beyond the recursion limit (e.g. `Struct` metadata), invalid UTF-8 in a
`string` field, truncated messages. So the RolloutService handlers are registered with a tolerant
deserializer that returns an `Undecodable` marker instead of raising; the status decorators turn
the marker into INVALID_ARGUMENT naming the request (`status.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc


class Undecodable:
    """Stands for a request whose bytes did not parse; `error` says why."""

    __slots__ = ("error", "message_type")

    def __init__(self, message_type: str, error: str) -> None:
        self.message_type = message_type
        self.error = error


def tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """Wrap a `FromString` so that undecodable bytes give an `Undecodable` instead of raising."""
    name = getattr(getattr(parse, "__self__", None), "__name__", "request")

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except (DecodeError, RecursionError, UnicodeDecodeError) as exc:
            return Undecodable(name, str(exc) or type(exc).__name__)

    return deserialize


class _TolerantRegistrar:
    """Receives the generated code's handler registration and registers tolerant copies."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the registered handlers below are added in their tolerant form instead."""

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        rewritten = {
            name: handler._replace(request_deserializer=tolerant(handler.request_deserializer))
            for name, handler in handlers.items()
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, rewritten),))
        self._server.add_registered_method_handlers(service, rewritten)


def add_rollout_service(servicer: pb_grpc.RolloutServiceServicer, server: grpc.aio.Server) -> None:
    """`add_RolloutServiceServicer_to_server`, with tolerant request deserializers."""
    # The generated function only calls the two registration methods the registrar provides.
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, cast(grpc.aio.Server, _TolerantRegistrar(server)))
