"""Per-RPC observation: a server interceptor that measures every rollout RPC and reports it.

The interceptor builds one `CallRecord` per RPC from what the transport sees (the request, the
streamed responses, the final sample, the status code) and hands it to the listeners: the
Prometheus metrics (`metrics.py`) and the per-Generate log line (`log_generate`). It needs no hook
inside the generation loop:

* TTFT is the time from the call's start to the first message carrying tokens;
* new tokens, engines, weight versions, failovers and the final status come from the final sample;
* the queue wait is written into the call's record by `TimedAdmission` through a context variable
  (the handler runs in the interceptor's task, so the record is visible there);
* a call that ends without a sample (refused, invalid, cancelled, past its deadline) is recorded
  with its status code, so every Generate that ends leaves exactly one log line.

A Generate without `request_id` gets its generated id here, before the handler runs, so that the log
line, the trace and the `x-request-id` header agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.inflight import InFlight

log = structlog.get_logger("rollout_grpc.server.facade.calls")

SERVICE_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["RolloutService"].full_name + "/"
_STATUS_NAMES = {v: k.removeprefix("SAMPLE_STATUS_") for k, v in pb.SampleStatus.items()}


@dataclass(slots=True)
class CallRecord:
    """What one rollout RPC did, as seen by the transport."""

    method: str
    request: Any
    started: float = field(default_factory=time.monotonic)
    ended: float = 0.0
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    #: Seconds from the call's start to the first message with tokens (Generate); None without.
    ttft_s: float | None = None
    #: Seconds the generation waited for an admission slot (Generate); None if it never asked.
    queue_wait_s: float | None = None
    #: The final sample (Generate), None when the call ended without one.
    sample: pb.Sample | None = None
    #: The response of a unary call (Abort, Pause, Resume, ...), None on error.
    response: Any = None

    @property
    def duration_s(self) -> float:
        """Seconds from start to end."""
        return self.ended - self.started

    @property
    def new_tokens(self) -> int:
        """Tokens this call generated (a continued sample already had some)."""
        if self.sample is None:
            return 0
        return max(0, int(self.sample.response_length) - int(self.request.sample.response_length))

    @property
    def engine_attempts(self) -> list[pb.EngineAttempt]:
        """The engine calls of this Generate (earlier calls of a continued sample excluded)."""
        if self.sample is None:
            return []
        return list(self.sample.engine_attempts[len(self.request.sample.engine_attempts) :])

    @property
    def weight_versions(self) -> list[str]:
        """Weight versions of the tokens this call generated, in order, without repeats."""
        if self.sample is None:
            return []
        start = self.request.sample.response_length
        versions: list[str] = []
        for span in self.sample.weight_versions:
            if span.end > start and span.version not in versions:
                versions.append(span.version)
        return versions

    @property
    def status(self) -> str:
        """The final sample's status name, or the gRPC code's name when there was no sample."""
        if self.sample is not None:
            return _STATUS_NAMES.get(self.sample.status, str(self.sample.status))
        return self.code.name


Listener = Callable[[CallRecord], None]

#: The record of the RPC the current task serves (set by the interceptor).
CURRENT_CALL: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("rollout_call", default=None)


class TimedAdmission(Admission):
    """Admission that writes each generation's queue wait into the current call's record."""

    @contextlib.asynccontextmanager
    async def slot(self, entry: InFlight) -> AsyncIterator[None]:
        started = time.monotonic()
        async with super().slot(entry):
            record = CURRENT_CALL.get()
            if record is not None:
                record.queue_wait_s = time.monotonic() - started
            yield


def _final_code(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException | None) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode) and (code is not grpc.StatusCode.OK or exc is None):
        return code
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    if exc is not None:
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.OK


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Measures every `rollout.v1.RolloutService` RPC and reports a `CallRecord` to the listeners."""

    def __init__(self, listeners: list[Listener]) -> None:
        self.listeners = listeners

    def _finish(
        self, record: CallRecord, context: grpc.aio.ServicerContext[Any, Any], exc: BaseException | None
    ) -> None:
        record.ended = time.monotonic()
        record.code = _final_code(context, exc)
        details = context.details() if record.code is not grpc.StatusCode.OK else ""
        record.details = details.decode() if isinstance(details, bytes) else str(details or "")
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:  # an observer bug must never fail the RPC
                log.exception("call_listener_failed", method=record.method)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or not full.startswith(SERVICE_PREFIX):
            return handler
        method = full.removeprefix(SERVICE_PREFIX)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _wrap_unary(self, method: str, behavior: Any) -> Any:
        async def observed(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            record = CallRecord(method, request)
            token = CURRENT_CALL.set(record)
            try:
                record.response = await behavior(request, context)
            except BaseException as exc:
                self._finish(record, context, exc)
                raise
            finally:
                CURRENT_CALL.reset(token)
            self._finish(record, context, None)
            return record.response

        return observed

    def _wrap_stream(self, method: str, behavior: Any) -> Any:
        async def observed(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            if isinstance(request, pb.GenerateRequest) and not request.request_id:
                request.request_id = uuid.uuid4().hex
            record = CallRecord(method, request)
            token = CURRENT_CALL.set(record)
            try:
                async for message in behavior(request, context):
                    if isinstance(message, pb.GenerateResponse):
                        kind = message.WhichOneof("event")
                        if kind == "sample":
                            record.sample = message.sample
                            if record.ttft_s is None and record.new_tokens > 0:
                                record.ttft_s = time.monotonic() - record.started
                        elif kind == "delta" and record.ttft_s is None and message.delta.token_ids:
                            record.ttft_s = time.monotonic() - record.started
                    yield message
            except BaseException as exc:
                self._finish(record, context, exc)
                raise
            finally:
                CURRENT_CALL.reset(token)
            self._finish(record, context, None)

        return observed


def log_generate(record: CallRecord) -> None:
    """The one log line of every Generate that ends, whatever its outcome."""
    if record.method != "Generate":
        return
    request = record.request
    sample = record.sample
    fields: dict[str, Any] = {
        "request_id": request.request_id,
        "sample_index": request.sample.index,
        "group_index": request.sample.group_index,
        "session_id": request.sample.session_id or None,
        "status": record.status,
        "code": record.code.name,
        "engines": [a.engine for a in record.engine_attempts],
        "weight_versions": record.weight_versions,
        "new_tokens": record.new_tokens,
        "queue_wait_ms": None if record.queue_wait_s is None else round(record.queue_wait_s * 1000, 2),
        "ttft_ms": None if record.ttft_s is None else round(record.ttft_s * 1000, 2),
        "latency_ms": round(record.duration_s * 1000, 2),
    }
    if sample is not None:
        fields["finish"] = pb.FinishReason.Name(sample.finish_reason).removeprefix("FINISH_REASON_")
        if sample.failure_reason:
            fields["failure"] = sample.failure_reason
        failovers = max(0, len(record.engine_attempts) - 1)
        if failovers:
            fields["failovers"] = failovers
    elif record.details:
        fields["error"] = record.details
    if record.code is grpc.StatusCode.OK and sample is not None:
        log.info("generate_done", **fields)
    else:
        log.warning("generate_done", **fields)
