"""Request bounds and per-caller control rate limits, checked before any work is done.

Every cap is a `ServerConfig` field and a CLI flag (table in docs/security.md). A request over a
size cap is refused with INVALID_ARGUMENT naming the field and the limit (e.g. `sample.metadata:
4194304 bytes, over the limit max_metadata_bytes=1048576`); a caller over its control-RPC rate is
refused with RESOURCE_EXHAUSTED and a retry hint. The per-caller in-flight share is enforced where
generations are registered (`inflight.InFlightRegistry`); image byte and pixel limits belong to
`render.py`.

`LimitsInterceptor` must run inside `auth.AuthInterceptor` (listed after it): the rate limit is per
caller, read from `identity.current_caller()`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain.errors import InvalidArgument, ResourceExhausted, RolloutError
from rollout_grpc.server.domain.identity import current_caller
from rollout_grpc.server.front.grpc import status

_ROLLOUT = "/rollout.v1.RolloutService/"
#: Public control RPCs, rate-limited per caller (replica-to-replica AbortLocal is not: one caller's
#: abort fans out to every peer, and peers are trusted).
RATE_LIMITED_METHODS = frozenset({_ROLLOUT + "Abort", _ROLLOUT + "Pause", _ROLLOUT + "Resume"})
_CHECKED_SERVICES = (_ROLLOUT, "/rollout.v1.ReplicaService/")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request caps (see docs/security.md for the reasoning behind each default)."""

    #: Request ids in one Abort (each costs engine work on every engine).
    max_abort_ids: int = 1024
    #: Serialized size of `Sample.metadata` (echoed back in the final sample).
    max_metadata_bytes: int = 1 << 20
    #: Entries of `SamplingParams.stop`.
    max_stop_strings: int = 64
    #: Characters of one stop string.
    max_stop_string_chars: int = 1024
    #: Serialized size of `RenderRequest.chat_template_kwargs`.
    max_chat_template_kwargs_bytes: int = 64 << 10

    def check(self, request: object) -> None:
        """Raise InvalidArgument naming the field and limit when `request` exceeds a cap."""
        if isinstance(request, pb.GenerateRequest):
            self._check_generate(request)
        elif isinstance(request, pb.AbortRequest | pb.AbortLocalRequest):
            if request.WhichOneof("target") == "request_ids":
                self._check_ids(len(request.request_ids.ids))
        elif isinstance(request, pb.RenderRequest) and request.HasField("chat_template_kwargs"):
            size = request.chat_template_kwargs.ByteSize()
            if size > self.max_chat_template_kwargs_bytes:
                raise InvalidArgument(
                    "chat_template_kwargs",
                    f"{size} bytes, over the limit max_chat_template_kwargs_bytes="
                    f"{self.max_chat_template_kwargs_bytes}",
                )

    def _check_ids(self, count: int) -> None:
        if count > self.max_abort_ids:
            raise InvalidArgument(
                "request_ids.ids",
                f"{count} ids, over the limit max_abort_ids={self.max_abort_ids}; split the abort",
            )

    def _check_generate(self, request: pb.GenerateRequest) -> None:
        if request.sample.HasField("metadata"):
            size = request.sample.metadata.ByteSize()
            if size > self.max_metadata_bytes:
                raise InvalidArgument(
                    "sample.metadata",
                    f"{size} bytes, over the limit max_metadata_bytes={self.max_metadata_bytes}",
                )
        self.check_stop(request.sampling_params.stop, "sampling_params.stop")

    def check_stop(self, stop: Sequence[str], field: str) -> None:
        """Raise InvalidArgument naming `field` when the stop strings exceed their caps."""
        if len(stop) > self.max_stop_strings:
            raise InvalidArgument(
                field,
                f"{len(stop)} stop strings, over the limit max_stop_strings={self.max_stop_strings}",
            )
        for i, text in enumerate(stop):
            if len(text) > self.max_stop_string_chars:
                raise InvalidArgument(
                    f"{field}[{i}]",
                    f"{len(text)} characters, over the limit "
                    f"max_stop_string_chars={self.max_stop_string_chars}",
                )

    def check_size(self, field: str, size: int, limit: str) -> None:
        """Raise InvalidArgument naming `field` when `size` bytes exceed the cap named `limit`
        (`max_metadata_bytes` or `max_chat_template_kwargs_bytes`); for callers outside gRPC,
        such as the OpenAI front door, which measure their JSON themselves."""
        cap = int(getattr(self, limit))
        if size > cap:
            raise InvalidArgument(field, f"{size} bytes, over the limit {limit}={cap}")


class ControlRateLimiter:
    """A token bucket per caller identity: `burst` calls at once, refilled at `rate_per_s`."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate_per_s
        self._burst = max(1, burst)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}

    @property
    def enabled(self) -> bool:
        """A rate of 0 or less disables the limit."""
        return self._rate > 0

    def acquire(self, identity: str) -> None:
        """Take one call from `identity`'s bucket, or raise ResourceExhausted naming the limit."""
        if not self.enabled:
            return
        now = self._clock()
        tokens, last = self._buckets.get(identity, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - last) * self._rate)
        if tokens < 1.0:
            wait = (1.0 - tokens) / self._rate
            self._buckets[identity] = (tokens, now)
            raise ResourceExhausted(
                f"control RPC rate limit for caller {identity!r} reached (control_rate_per_s="
                f"{self._rate:g}, control_burst={self._burst}); retry in {wait:.2f} s",
                wait,
            )
        self._buckets[identity] = (tokens - 1.0, now)


class LimitsInterceptor(grpc.aio.ServerInterceptor):
    """Checks request bounds and the per-caller control rate before the servicer runs."""

    def __init__(self, limits: RequestLimits, rate: ControlRateLimiter) -> None:
        self._limits = limits
        self._rate = rate

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(
            ("/rollout.v1.RolloutService/", "/rollout.v1.ReplicaService/")
        ):
            return handler
        limited = method in RATE_LIMITED_METHODS

        async def check(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            try:
                self._limits.check(request)
                if limited:
                    self._rate.acquire(current_caller().identity)
            except RolloutError as exc:
                await context.abort_with_status(status.to_status(exc))

        if handler.unary_unary is not None:
            inner_uu: Any = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                await check(request, context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_us: Any = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                await check(request, context)
                async for message in inner_us(request, context):
                    yield message

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler
