"""The one per-call wrapper of the gRPC door: record, authenticate, bound, run, map the outcome.

Every RPC of `rollout.v1.RolloutService` and `rollout.v1.ReplicaService` runs inside one wrapper
(one server interceptor) that, per call and in this order:

1. opens the call's record in the facade's `CallBook` (rollout RPCs), so that a call refused at
   the door leaves its log line and metrics like one that generated;
2. authenticates the caller from the `authorization` metadata or the verified client certificate
   (`security.auth`) BEFORE any request byte is read (`wire.py`: the methods are registered at
   the wire level as request-streaming, undecoded); UNAUTHENTICATED otherwise, RESOURCE_EXHAUSTED
   past the peer's budget of failed authentications (`security.refusals`);
3. reads the one request message as bytes, refuses it over the method's cap before decoding it
   (`max_control_request_bytes` for every method but Generate, RolloutStep and Render), decodes
   it, checks the role against `METHOD_ROLES` and binds the caller to the call
   (`identity.set_caller`; PERMISSION_DENIED otherwise);
4. refuses request bytes that did not decode (`decoding.py`), requests over a size cap
   (`security.limits.RequestLimits`) and control RPCs over the caller's rate;
5. runs the servicer: a stream's messages pass through this wrapper's one loop untouched (no
   per-message inspection: the facade observes the domain events before conversion);
6. maps a domain error to its rich status (`status.to_status`), anything unexpected to INTERNAL
   with a generic message, and closes the record with the code the caller got. A stream whose
   final sample was already sent is OK even if the client leaves before reading the trailers.

Control RPCs leave one `audit` line with the caller, target and outcome, refusals included
(refusals within `RefusalSampler`'s bound; the rest are counted on the next line). Health is
always open (probes carry no credentials) and its requests are capped at `max_open_request_bytes`;
reflection is open, or needs any valid credential (`AuthConfig.reflection_open`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain.errors import InvalidArgument, ResourceExhausted, RolloutError
from rollout_grpc.server.domain.identity import Caller, Role, current_caller, set_caller
from rollout_grpc.server.facade.calls import CallRecord, Door
from rollout_grpc.server.facade.door import CallBook
from rollout_grpc.server.facade.values import MAX_GROUPS
from rollout_grpc.server.front.grpc import redaction, status, wire
from rollout_grpc.server.front.grpc.decoding import Undecodable
from rollout_grpc.server.security.auth import AuthConfig, Presented, Refused, authenticate, authorize
from rollout_grpc.server.security.limits import ControlRateLimiter, RequestLimits
from rollout_grpc.server.security.refusals import AuthFailureLimiter, RefusalSampler

log = structlog.get_logger(__name__)
audit_log = structlog.get_logger("rollout_grpc.audit")

ROLLOUT = "/" + pb.DESCRIPTOR.services_by_name["RolloutService"].full_name + "/"
REPLICA = "/" + pb.DESCRIPTOR.services_by_name["ReplicaService"].full_name + "/"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")

#: Which roles may call which method. A method of these services missing here is refused.
METHOD_ROLES: dict[str, frozenset[Role]] = {
    ROLLOUT + "Generate": frozenset({Role.TRAINER, Role.ADMIN}),
    ROLLOUT + "Render": frozenset({Role.TRAINER, Role.ADMIN}),
    ROLLOUT + "GetServerInfo": frozenset({Role.TRAINER, Role.ADMIN}),
    # A rollout step is many Generates of the caller (same admission, same per-caller cap).
    ROLLOUT + "RolloutStep": frozenset({Role.TRAINER, Role.ADMIN}),
    # Front-door sessions are collected by the trainer that drives the agent harness.
    ROLLOUT + "GetTrajectory": frozenset({Role.TRAINER, Role.ADMIN}),
    # Abort(all) and other callers' generations are admin-only; control.py scopes the rest.
    ROLLOUT + "Abort": frozenset({Role.TRAINER, Role.ADMIN}),
    ROLLOUT + "Pause": frozenset({Role.ADMIN}),
    ROLLOUT + "Resume": frozenset({Role.ADMIN}),
    # Moves the whole fleet to new weights: the same power as Pause + Resume.
    ROLLOUT + "UpdateWeights": frozenset({Role.ADMIN}),
    ROLLOUT + "PlanWeightTransfer": frozenset({Role.ADMIN}),
    ROLLOUT + "ReleaseMemory": frozenset({Role.ADMIN}),
    ROLLOUT + "ResumeMemory": frozenset({Role.ADMIN}),
    REPLICA + "AbortLocal": frozenset({Role.PEER, Role.ADMIN}),
}

#: The control RPCs: audited, and rate-limited per caller (below).
CONTROL_METHODS = frozenset(
    {
        ROLLOUT + "Abort",
        ROLLOUT + "Pause",
        ROLLOUT + "Resume",
        ROLLOUT + "UpdateWeights",
        ROLLOUT + "PlanWeightTransfer",
        ROLLOUT + "ReleaseMemory",
        ROLLOUT + "ResumeMemory",
        REPLICA + "AbortLocal",
    }
)
#: Public control RPCs, rate-limited per caller (replica-to-replica AbortLocal is not: one caller's
#: abort fans out to every peer, and peers are trusted).
RATE_LIMITED_METHODS = frozenset(
    {
        ROLLOUT + "Abort",
        ROLLOUT + "Pause",
        ROLLOUT + "Resume",
        ROLLOUT + "UpdateWeights",
        ROLLOUT + "PlanWeightTransfer",
        ROLLOUT + "ReleaseMemory",
        ROLLOUT + "ResumeMemory",
    }
)
#: The RPCs whose requests carry payloads (prompts, partial samples with routed experts, images),
#: read up to the gRPC message limit once the caller may call them. Every other method's request
#: is capped at `RequestLimits.max_control_request_bytes` before it is decoded.
PAYLOAD_METHODS = frozenset({ROLLOUT + "Generate", ROLLOUT + "RolloutStep", ROLLOUT + "Render"})

Context = grpc.aio.ServicerContext[Any, Any]


def check_request(limits: RequestLimits, request: object) -> None:
    """InvalidArgument naming the field and limit when `request` exceeds a cap, or did not decode."""
    if isinstance(request, Undecodable):
        raise InvalidArgument("request", f"the bytes are not a valid {request.message_type}: {request.error}")
    if isinstance(request, pb.GenerateRequest):
        if request.sample.HasField("metadata"):
            limits.check_size("sample.metadata", request.sample.metadata.ByteSize(), "max_metadata_bytes")
        limits.check_stop(request.sampling_params.stop, "sampling_params.stop")
    elif isinstance(request, pb.RolloutStepRequest):
        _check_step(limits, request)
    elif isinstance(request, pb.AbortRequest | pb.AbortLocalRequest):
        if request.WhichOneof("target") == "request_ids":
            limits.check_ids(len(request.request_ids.ids))
    elif isinstance(request, pb.RenderRequest):
        _check_render(limits, request)


def _check_render(limits: RequestLimits, request: pb.RenderRequest) -> None:
    """A render's prompt text and template arguments, before anything goes to an engine."""
    if request.HasField("chat_template_kwargs"):
        limits.check_size(
            "chat_template_kwargs", request.chat_template_kwargs.ByteSize(), "max_chat_template_kwargs_bytes"
        )
    if request.WhichOneof("prompt") == "text":
        limits.check_prompt("text", len(request.text))
    elif request.WhichOneof("prompt") == "chat":
        chars = sum(len(part.text) for m in request.chat.messages for part in m.content)
        limits.check_prompt("chat.messages", chars)


def _check_step(limits: RequestLimits, request: pb.RolloutStepRequest) -> None:
    """A rollout step is held to the caps of each of its Generates."""
    limits.check_stop(request.sampling_params.stop, "sampling_params.stop")
    if len(request.groups) > MAX_GROUPS:  # before the loop below walks them
        raise InvalidArgument("groups", f"at most {MAX_GROUPS} groups per step, got {len(request.groups)}")
    for i, group in enumerate(request.groups):
        if group.prompt.HasField("prompt"):
            limits.check_prompt(f"groups[{i}].prompt.prompt", len(group.prompt.prompt))
        for j, sample in enumerate([group.prompt, *group.partial]):
            if sample.HasField("metadata"):
                where = f"groups[{i}].prompt" if j == 0 else f"groups[{i}].partial[{j - 1}]"
                limits.check_size(where + ".metadata", sample.metadata.ByteSize(), "max_metadata_bytes")


def _auth_values(auth_context: Mapping[str, Iterable[bytes]], key: str) -> list[str]:
    return [v.decode(errors="replace") for v in auth_context.get(key, ())]


def presented(context: Context) -> Presented:
    """The credentials of a call: its `authorization` metadata and its client certificate's names."""
    authorization = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            authorization = str(value)
            break
    auth = context.auth_context() or {}
    names = _auth_values(auth, "x509_subject_alternative_name") + _auth_values(auth, "x509_common_name")
    return Presented(authorization, names)


def describe_target(method: str, request: object) -> dict[str, object]:
    """What a control RPC acts on, for the audit line (never the whole request)."""
    if isinstance(request, pb.AbortRequest | pb.AbortLocalRequest):
        target = request.WhichOneof("target")
        described: dict[str, object] = {"target": target}
        if target == "request_ids":
            ids = list(request.request_ids.ids)
            described["request_ids"] = ids[:8]
            described["request_id_count"] = len(ids)
        elif target is not None:
            described[target] = getattr(request, target)
        if isinstance(request, pb.AbortLocalRequest):
            described["owner"] = request.owner
        return described
    if isinstance(request, pb.PauseRequest):
        return {
            "mode": pb.PauseMode.Name(request.mode) if request.mode in pb.PauseMode.values() else request.mode
        }
    if isinstance(request, pb.ResumeRequest):
        return {"weight_version": request.weight_version if request.HasField("weight_version") else None}
    return _describe_weights_target(request)


def _describe_weights_target(request: object) -> dict[str, object]:
    """The audit target of the weight and memory RPCs (UpdateWeights, PlanWeightTransfer, ...)."""
    if isinstance(request, pb.ReleaseMemoryRequest):
        return {"level": request.level if request.HasField("level") else None, "tags": list(request.tags)[:4]}
    if isinstance(request, pb.PlanWeightTransferRequest):
        return {"trainer_ranks": request.trainer_ranks}
    if isinstance(request, pb.ResumeMemoryRequest):
        return {"tags": list(request.tags)[:4]}
    if isinstance(request, pb.UpdateWeightsRequest):
        return {
            "weight_version": request.weight_version[:256],
            "source": request.WhichOneof("source"),
            "path": request.checkpoint.path[:256] if request.HasField("checkpoint") else None,
            "rendezvous": (
                f"{request.distributed.master_address[:128]}:{request.distributed.master_port}"
                if request.HasField("distributed")
                else None
            ),
            "pause_mode": request.pause_mode,
        }
    return {}


def _describe_result(response: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for field in ("aborted", "paused_engines", "resumed_engines", "released_engines", "engine_errors"):
        if hasattr(response, field):
            value = getattr(response, field)
            out[field] = value if isinstance(value, int) else len(value)
    if isinstance(response, pb.UpdateWeightsResponse):
        out["updated_engines"] = sum(1 for e in response.engines if e.updated)
        out["paused_seconds"] = round(response.paused_seconds, 3)
    return out


def _code_name(context: Context, exc: BaseException | None, sample_sent: bool) -> str:
    """The status code the caller got, from the context (an abort sets it) or the exception."""
    code = context.code()
    if isinstance(code, grpc.StatusCode) and (code is not grpc.StatusCode.OK or exc is None):
        return code.name
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        if sample_sent:
            return "OK"  # the sample was delivered; the client left before reading the trailers
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    return "UNKNOWN" if exc is not None else "OK"


def _request_cap(method: str) -> str | None:
    """The `RequestLimits` cap of a method's serialized request (None: the gRPC message limit)."""
    return None if method in PAYLOAD_METHODS else "max_control_request_bytes"


class _Unread(Exception):
    """A refusal before the request was read (`request` is None)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error
        self.request: object = None


class _Refusal(Exception):
    """A refusal after the request was read and decoded."""

    def __init__(self, error: Exception, request: object) -> None:
        super().__init__(str(error))
        self.error = error
        self.request = request


def _details(context: Context) -> str:
    details = context.details()
    return details.decode() if isinstance(details, bytes) else str(details or "")


class RpcInterceptor(grpc.aio.ServerInterceptor):
    """The one per-call wrapper (see the module docstring).

    It must be the first interceptor of the server: it replaces each unary-request handler by its
    wire-level form (`wire.py`), so the interceptors after it (tracing) and the servicer see the
    decoded request as before, but only of a caller that was admitted."""

    def __init__(
        self,
        calls: CallBook,
        auth: AuthConfig,
        limits: RequestLimits,
        rate: ControlRateLimiter,
        engine_urls: Callable[[], Iterable[str]] = tuple,
        *,
        auth_failures: AuthFailureLimiter | None = None,
        refusal_audit: RefusalSampler | None = None,
    ) -> None:
        """`engine_urls`: the pool's engine addresses, replaced by labels in the error messages
        non-admins get. `auth_failures`: failed authentications per peer (default: 1/s, burst
        20); `refusal_audit`: how many refusals get an audit line (default: 1/s, burst 20)."""
        self._engine_urls = engine_urls
        self._calls = calls
        self._auth = auth
        self._limits = limits
        self._rate = rate
        self._auth_failures = auth_failures or AuthFailureLimiter(1.0, 20)
        self._refusal_audit = refusal_audit or RefusalSampler(1.0, 20)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None:
            return handler
        if method.startswith(HEALTH_PREFIX):
            return wire.open_service(handler, self._limits)
        if method.startswith(REFLECTION_PREFIXES):
            admit = None if self._config_open_reflection() else self._admit_reflection
            return wire.reflection(handler, self._limits, admit)
        deserialize = handler.request_deserializer or wire.undecoded
        if handler.unary_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(method, handler.unary_stream, deserialize),
                None,
                handler.response_serializer,
            )
        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary, deserialize),
                None,
                handler.response_serializer,
            )
        return handler

    def _config_open_reflection(self) -> bool:
        return not self._auth.enabled or self._auth.reflection_open

    # ----------------------------------------------------------------------------- per call

    def _open(self, method: str) -> CallRecord | None:
        if not method.startswith(ROLLOUT):
            return None
        return self._calls.open(Door.GRPC, method.removeprefix(ROLLOUT))

    async def _admit(
        self,
        method: str,
        context: Context,
        deserialize: wire.Deserialize,
        record: CallRecord | None,
    ) -> tuple[Caller, object]:
        """Authenticate the caller from the metadata, then read and decode the request, authorise,
        bind the caller to the call and check the request's bounds.

        Nothing of the request is read before the caller is authenticated; a non-control method's
        request is read only once the role may call it (a control method's, capped small, is read
        first so that a PERMISSION_DENIED audit line names its target). A refusal (`Refused` or
        a `RolloutError`, mapped by `_refuse`) is raised inside `_Unread` when the request was not
        read, inside `_Refusal` with the request when it was."""
        caller = self._authenticate(context, record)
        if record is not None:
            record.caller = caller.identity  # authenticated: its refusals name it in the log line
        control = method in CONTROL_METHODS
        try:
            if not control:
                self._authorize(method, caller)
            request = await wire.read_one(context, deserialize, self._limits, _request_cap(method))
        except (Refused, RolloutError) as exc:
            raise _Unread(exc) from None
        try:
            if control:
                self._authorize(method, caller)
            set_caller(caller)
            check_request(self._limits, request)
            if method in RATE_LIMITED_METHODS:
                self._rate.acquire(caller.identity)
        except (Refused, RolloutError) as exc:
            raise _Refusal(exc, request) from None
        return caller, request

    def _authenticate(self, context: Context, record: CallRecord | None) -> Caller:
        """The caller from the call's metadata or certificate, or `_Unread` with the refusal:
        UNAUTHENTICATED, or RESOURCE_EXHAUSTED past the peer's budget of failed authentications
        (then the call is counted in the metrics but writes no log line)."""
        try:
            return authenticate(self._auth, presented(context))
        except Refused as refused:
            try:
                self._auth_failures.failed(context.peer())
            except ResourceExhausted as flood:
                if record is not None:
                    record.log_line = False
                raise _Unread(flood) from None
            raise _Unread(refused) from None
        except RolloutError as exc:
            raise _Unread(exc) from None

    def _authorize(self, method: str, caller: Caller) -> None:
        if self._auth.enabled:
            authorize(caller, method.rsplit("/", 1)[-1], METHOD_ROLES.get(method, frozenset()))

    async def _refuse(self, method: str, context: Context, request: object, exc: Exception) -> None:
        """Abort the call with the status of `exc` (audited for control methods, within the
        refusal audit's bound); always raises."""
        if isinstance(exc, _Unread | _Refusal):
            request, exc = exc.request, exc.error
        if isinstance(exc, Refused):
            if method in CONTROL_METHODS:
                self._audit_refusal(method, context, request, exc)
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        if isinstance(exc, RolloutError):
            if not current_caller().is_admin:
                redaction.redact_error(exc, self._engine_urls())
            await context.abort_with_status(status.to_status(exc))
        log.exception("internal_error", exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by the server)")

    def _audit_refusal(self, method: str, context: Context, request: object, exc: Refused) -> None:
        """One audit line for a refused control RPC, unless the refusal audit's bound is reached
        (then counted, and the count written with the next line)."""
        left_out = self._refusal_audit.admit()
        if left_out is None:
            return
        who = exc.caller
        extra: dict[str, object] = {"suppressed_refusals": left_out} if left_out else {}
        audit_log.warning(
            "audit",
            method=method,
            caller=who.identity if who else None,
            role=who.role.value if who else None,
            peer=context.peer(),
            outcome=exc.code,
            **describe_target(method, request),
            **extra,
        )

    def _close(
        self,
        record: CallRecord | None,
        context: Context,
        exc: BaseException | None,
        sample_sent: bool = False,
    ) -> None:
        if record is None:
            return
        code = _code_name(context, exc, sample_sent)
        self._calls.close(record, code, _details(context) if code != "OK" else "")

    def _wrap_unary(self, method: str, inner: Any, deserialize: wire.Deserialize) -> Any:
        audited = method in CONTROL_METHODS

        async def unary(requests: AsyncIterator[bytes], context: Context) -> Any:
            record = self._open(method)
            request: object = None
            try:
                try:
                    caller, request = await self._admit(method, context, deserialize, record)
                    if audited:
                        response = await self._audited(method, request, context, inner, caller)
                    else:
                        response = await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await self._refuse(method, context, request, exc)
                    raise  # unreachable: abort raises
            except BaseException as exc:
                self._close(record, context, exc)
                raise
            self._close(record, context, None)
            return response

        return unary

    def _wrap_stream(self, method: str, inner: Any, deserialize: wire.Deserialize) -> Any:
        async def stream(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
            record = self._open(method)
            request: object = None
            #: The final sample was handed to gRPC (it is the one message sent after the facade
            #: recorded the sample): a client that leaves after it got what it asked for.
            delivered = False
            try:
                try:
                    _, request = await self._admit(method, context, deserialize, record)
                    async for message in inner(request, context):
                        delivered = delivered or (record is not None and record.sample is not None)
                        yield message
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await self._refuse(method, context, request, exc)
            except BaseException as exc:
                self._close(record, context, exc, delivered)
                raise
            self._close(record, context, None, delivered)

        return stream

    async def _audited(
        self, method: str, request: object, context: Context, inner: Any, caller: Caller
    ) -> Any:
        """Run a control RPC and log one audit line with the caller, target and outcome."""
        fields: dict[str, object] = {
            "method": method,
            "caller": caller.identity,
            "role": caller.role.value,
            "peer": context.peer(),
            **describe_target(method, request),
        }
        try:
            response = await inner(request, context)
        except BaseException as exc:
            code = context.code() if isinstance(exc, grpc.aio.AbortError) else None
            if isinstance(exc, RolloutError):
                outcome = exc.code
            else:
                outcome = code.name if isinstance(code, grpc.StatusCode) else type(exc).__name__
            audit_log.warning("audit", outcome=outcome, **fields)
            raise
        audit_log.info("audit", outcome="OK", **fields, **_describe_result(response))
        return response

    async def _admit_reflection(self, context: Context) -> None:
        """Guarded reflection: any valid credential, bound to the call; else the refusal."""
        try:
            set_caller(authenticate(self._auth, presented(context)))
        except Refused as refused:
            await context.abort(grpc.StatusCode[refused.code], refused.message)
