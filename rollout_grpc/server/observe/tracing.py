"""Optional OpenTelemetry tracing: a span per RPC and per engine call, W3C context end to end.

Off by default; `--otlp-endpoint host:port` turns it on with an OTLP/gRPC exporter (install the
`tracing` extra: `pip install 'rollout-grpc[tracing]'`). Tests pass their own `TracerProvider`.

* `TracingInterceptor` (a grpc.aio server interceptor) continues the caller's trace from the W3C
  `traceparent`/`tracestate` gRPC metadata and opens a SERVER span per rollout RPC, with the sample
  identity (request id, sample index, group index, session id) as attributes.
* `engine_tracing` is an `aiohttp.TraceConfig` for the shared engine session: each engine HTTP call
  gets a CLIENT span, child of the RPC span, and a `traceparent` header, which vLLM continues when
  started with `--otlp-traces-endpoint`. The engine adapter (`engines/vllm/adapter.py`) is not involved.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import Token
from types import SimpleNamespace
from typing import Any

import aiohttp
import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from rollout_grpc import __version__
from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.facade.calls import CURRENT_CALL, CallRecord

INSTRUMENTATION = "rollout_grpc"
SERVICE_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["RolloutService"].full_name + "/"


def otlp_provider(endpoint: str) -> TracerProvider:
    """A tracer provider exporting to an OTLP/gRPC collector at `endpoint` (plaintext)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": "rollout-grpc"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return provider


def _identity(request: Any) -> dict[str, Any]:
    """Span attributes naming the sample of a Generate (or the target of an Abort)."""
    attributes: dict[str, Any] = {}
    if hasattr(request, "request_id") and request.request_id:
        attributes["rollout.request_id"] = request.request_id
    sample = getattr(request, "sample", None)
    if sample is not None:
        attributes["rollout.sample_index"] = sample.index
        attributes["rollout.group_index"] = sample.group_index
        if sample.session_id:
            attributes["rollout.session_id"] = sample.session_id
    return attributes


def _record_identity(record: CallRecord) -> dict[str, Any]:
    """The sample identity of the call an engine request belongs to, as span attributes."""
    attributes: dict[str, Any] = {}
    if record.request_id:
        attributes["rollout.request_id"] = record.request_id
    if record.method == "Generate" or record.sample is not None or record.session_id:
        attributes["rollout.sample_index"] = record.sample_index
        attributes["rollout.group_index"] = record.group_index
        if record.session_id:
            attributes["rollout.session_id"] = record.session_id
    return attributes


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per rollout RPC, continuing the caller's W3C trace context."""

    def __init__(self, provider: trace.TracerProvider) -> None:
        self._tracer = provider.get_tracer(INSTRUMENTATION, __version__)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or not full.startswith(SERVICE_PREFIX):
            return handler
        spans = _RpcSpans(self._tracer, full, handler_call_details.invocation_metadata)
        if handler.unary_stream is not None:
            return _traced_stream(handler, spans)
        if handler.unary_unary is not None:
            return _traced_unary(handler, spans)
        return handler


class _RpcSpans:
    """Opens and closes the SERVER span of one RPC, child of the caller's trace context."""

    def __init__(self, tracer: trace.Tracer, full_method: str, metadata: Any) -> None:
        carrier = {k: v if isinstance(v, str) else v.decode() for k, v in (metadata or ())}
        self.parent = propagate.extract(carrier)
        self._tracer = tracer
        self._name = full_method.lstrip("/")
        self._method = full_method.removeprefix(SERVICE_PREFIX)

    def start(self, request: Any) -> tuple[trace.Span, Token[Context]]:
        """The started span (with the sample identity) and the token of its attached context."""
        span = self._tracer.start_span(
            self._name,
            context=self.parent,
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": SERVICE_PREFIX.strip("/"),
                "rpc.method": self._method,
                **_identity(request),
            },
        )
        return span, otel_context.attach(trace.set_span_in_context(span, self.parent))

    @staticmethod
    def end(
        span: trace.Span,
        token: Token[Context],
        context: grpc.aio.ServicerContext[Any, Any],
        exc: BaseException | None,
    ) -> None:
        """Record the RPC's status code (or the exception) and the new tokens; end and detach."""
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, code.name))
        elif exc is not None:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        record = CURRENT_CALL.get()
        if record is not None and record.sample is not None:
            span.set_attribute("rollout.new_tokens", record.new_tokens)
        span.end()
        otel_context.detach(token)


def _traced_stream(
    handler: grpc.RpcMethodHandler[Any, Any], spans: _RpcSpans
) -> grpc.RpcMethodHandler[Any, Any]:
    """A server-streaming handler run inside its RPC span."""
    behavior: Any = handler.unary_stream

    async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        span, token = spans.start(request)
        error: BaseException | None = None
        try:
            async for message in behavior(request, context):
                yield message
        except BaseException as exc:
            error = exc
            raise
        finally:
            spans.end(span, token, context, error)

    return grpc.unary_stream_rpc_method_handler(
        stream,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _traced_unary(
    handler: grpc.RpcMethodHandler[Any, Any], spans: _RpcSpans
) -> grpc.RpcMethodHandler[Any, Any]:
    """A unary handler run inside its RPC span."""
    behavior: Any = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        span, token = spans.start(request)
        error: BaseException | None = None
        try:
            return await behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            spans.end(span, token, context, error)

    return grpc.unary_unary_rpc_method_handler(
        unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def engine_tracing(provider: trace.TracerProvider) -> aiohttp.TraceConfig:
    """CLIENT spans for engine HTTP calls, with `traceparent` injected into the request headers."""
    tracer = provider.get_tracer(INSTRUMENTATION, __version__)

    async def on_start(
        session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceRequestStartParams
    ) -> None:
        attributes: dict[str, Any] = {
            "http.request.method": params.method,
            "url.full": str(params.url),
            "server.address": params.url.host or "",
        }
        record = CURRENT_CALL.get()
        if record is not None:
            attributes.update(_record_identity(record))
        span = tracer.start_span(
            f"{params.method} {params.url.path}", kind=SpanKind.CLIENT, attributes=attributes
        )
        ctx.otel_span = span
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        for key, value in carrier.items():
            params.headers[key] = value

    async def on_end(
        session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams
    ) -> None:
        span: trace.Span = ctx.otel_span
        span.set_attribute("http.response.status_code", params.response.status)
        if params.response.status >= 400:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {params.response.status}"))
        span.end()

    async def on_error(
        session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceRequestExceptionParams
    ) -> None:
        span: trace.Span = ctx.otel_span
        span.record_exception(params.exception)
        span.set_status(Status(StatusCode.ERROR, type(params.exception).__name__))
        span.end()

    config = aiohttp.TraceConfig()
    config.on_request_start.append(on_start)
    config.on_request_end.append(on_end)
    config.on_request_exception.append(on_error)
    return config
