"""The RolloutService stub, built from the service descriptor instead of the generated `_pb2_grpc`.

Why: the generated stub passes `_registered_method=True`, which grpc.aio channels accept only from
grpcio 1.63 on, and it would also need regenerating whenever an RPC is added. Building the
multi-callables from `rollout_pb2.DESCRIPTOR` gives the same object (attributes named after the
RPCs, same paths and (de)serialisers) on every grpcio the client supports, and picks up new RPCs
from the committed descriptor automatically. For type checkers it *is* the generated stub type.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, cast

from google.protobuf import descriptor_pb2

from rollout_grpc._proto import rollout_pb2 as pb

if TYPE_CHECKING:
    from rollout_grpc._proto.rollout_pb2_grpc import RolloutServiceAsyncStub, RolloutServiceStub

SERVICE = pb.DESCRIPTOR.services_by_name["RolloutService"]

#: (client streaming, server streaming) -> the channel's multi-callable factory.
_FACTORIES = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def _methods() -> list[tuple[str, str, Any, Any, str]]:
    """(attribute, path, request class, response class, factory) for every RPC of the service."""
    # MethodDescriptor has no streaming flags before protobuf 5; the descriptor proto always has.
    proto = descriptor_pb2.ServiceDescriptorProto()
    SERVICE.CopyToProto(proto)
    streaming = {m.name: (m.client_streaming, m.server_streaming) for m in proto.method}
    result = []
    for method in SERVICE.methods:
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        path = f"/{SERVICE.full_name}/{method.name}"
        result.append((method.name, path, request, response, _FACTORIES[streaming[method.name]]))
    return result


_METHODS = _methods()


class _DescriptorStub:
    """One multi-callable per RPC, as attributes named like the RPC (`stub.Generate(...)`)."""

    def __init__(self, channel: Any) -> None:
        for name, path, request, response, factory_name in _METHODS:
            factory = getattr(channel, factory_name)
            kwargs: dict[str, Any] = {
                "request_serializer": request.SerializeToString,
                "response_deserializer": response.FromString,
            }
            if _accepts_registered_method(factory):
                kwargs["_registered_method"] = True  # lets gRPC core skip per-call method lookup
            setattr(self, name, factory(path, **kwargs))


def _accepts_registered_method(factory: Any) -> bool:
    try:
        return "_registered_method" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def async_stub(channel: Any) -> RolloutServiceAsyncStub:
    """The stub on a grpc.aio channel."""
    return cast("RolloutServiceAsyncStub", _DescriptorStub(channel))


def sync_stub(channel: Any) -> RolloutServiceStub:
    """The stub on a blocking grpc channel."""
    return cast("RolloutServiceStub", _DescriptorStub(channel))
