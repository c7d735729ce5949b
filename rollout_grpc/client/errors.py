"""The exceptions the clients raise: one class per gRPC status a trainer handles, and EngineErrors.

Every RPC of `AsyncRolloutClient` and `RolloutClient` raises a `RolloutError` subclass instead of
grpc's own error objects (`grpc.aio.AioRpcError`, the sync client's private `_InactiveRpcError`),
with the server's rich details already decoded::

    try:
        sample = client.generate(ids, {"temperature": -1.0})
    except InvalidArgumentError as err:
        print(err.field_violations)      # [FieldViolation(field='sampling_params.temperature', ...)]
    except ResourceExhaustedError as err:
        time.sleep(err.retry_after or 1.0)

Backward compatibility: `RolloutError` subclasses `grpc.aio.AioRpcError` (itself a `grpc.RpcError`),
so code written against grpc's errors keeps working unchanged: `except grpc.RpcError` and
`except grpc.aio.AioRpcError` still catch, and `.code()`, `.details()`, `.trailing_metadata()`,
`.initial_metadata()` and `.debug_error_string()` answer as before (metadata as `grpc.aio.Metadata`,
which iterates as (key, value) pairs like the sync client's tuples).

The details are decoded without `googleapis-common-protos` (not a client dependency): the few
`google.rpc` messages involved are rebuilt below, wire-compatible, in a private descriptor pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

import grpc
from google.protobuf import descriptor_pb2, message_factory
from google.protobuf.message import DecodeError

from rollout_grpc._proto import rollout_pb2 as pb

STATUS_DETAILS_KEY = "grpc-status-details-bin"
PUSHBACK_KEY = "grpc-retry-pushback-ms"
_TYPE_URL_PREFIX = "type.googleapis.com/"


def _rpc_messages() -> dict[str, Any]:
    """google.rpc.Status, BadRequest (its FieldViolation) and RetryInfo, by their google.rpc names.

    Same field numbers and types as googleapis' status.proto and error_details.proto (Any and
    Duration inlined as messages of the same layout), so their bytes parse here unchanged.
    `message_factory.GetMessages` builds them in a pool of its own on protobuf 4.21 to 7.
    """
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="rollout_grpc/client/google_rpc_errors.proto", package="rollout_grpc.client.rpc", syntax="proto3"
    )

    def message(name: str, *fields: tuple[str, int, Any, Any, str]) -> None:
        file.message_type.add(
            name=name,
            field=[
                f(name=n, number=num, label=label, type=kind, type_name=ref or None)
                for n, num, label, kind, ref in fields
            ],
        )

    opt, rep, pkg = f.LABEL_OPTIONAL, f.LABEL_REPEATED, ".rollout_grpc.client.rpc."
    message("Any", ("type_url", 1, opt, f.TYPE_STRING, ""), ("value", 2, opt, f.TYPE_BYTES, ""))
    message("Duration", ("seconds", 1, opt, f.TYPE_INT64, ""), ("nanos", 2, opt, f.TYPE_INT32, ""))
    message(
        "Status",
        ("code", 1, opt, f.TYPE_INT32, ""),
        ("message", 2, opt, f.TYPE_STRING, ""),
        ("details", 3, rep, f.TYPE_MESSAGE, pkg + "Any"),
    )
    message(
        "FieldViolation", ("field", 1, opt, f.TYPE_STRING, ""), ("description", 2, opt, f.TYPE_STRING, "")
    )
    message("BadRequest", ("field_violations", 1, rep, f.TYPE_MESSAGE, pkg + "FieldViolation"))
    message("RetryInfo", ("retry_delay", 1, opt, f.TYPE_MESSAGE, pkg + "Duration"))
    classes = message_factory.GetMessages([file])
    return {name.replace("rollout_grpc.client.rpc.", "google.rpc."): cls for name, cls in classes.items()}


_RPC = _rpc_messages()


class FieldViolation(NamedTuple):
    """One `google.rpc.BadRequest` field violation: the request field at fault and what is wrong."""

    field: str
    description: str


def _value(metadata: Iterable[tuple[str, Any]] | None, key: str) -> Any:
    for k, v in metadata or ():
        if k == key:
            return v
    return None


class RolloutError(grpc.aio.AioRpcError):
    """A call the replica (or gRPC itself) ended with a non-OK status.

    The base of one class per status code a trainer handles; a code without a class of its own
    (UNKNOWN, UNIMPLEMENTED, OUT_OF_RANGE, ...) is raised as `RolloutError` itself. `code()` and
    `details()` are grpc's; `message` is the details as a string ("" when none). The constructor
    is `grpc.aio.AioRpcError`'s for every class, so its `__reduce__` pickles any of them (Ray workers
    pickle what they raise) and the details are decoded again from the trailers.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        initial_metadata: grpc.aio.Metadata | None = None,
        trailing_metadata: grpc.aio.Metadata | None = None,
        details: str | None = None,
        debug_error_string: str | None = None,
    ) -> None:
        super().__init__(code, initial_metadata, trailing_metadata, details, debug_error_string)
        self.message = details or ""
        #: The `google.rpc.Status` details of the error, as (type name, serialised message) pairs.
        self.status_details: list[tuple[str, bytes]] = _status_details(trailing_metadata)

    def __str__(self) -> str:
        return f"{self.code().name}: {self.message}"

    def _detail(self, type_name: str) -> Any:
        """The first status detail of this google.rpc type, parsed (None when absent)."""
        for name, data in self.status_details:
            if name == type_name:
                try:
                    return _RPC[type_name].FromString(data)
                except DecodeError:  # a malformed detail reads as an absent one
                    return None
        return None


def _status_details(trailing_metadata: Iterable[tuple[str, Any]] | None) -> list[tuple[str, bytes]]:
    """(type name, bytes) of each detail in the `grpc-status-details-bin` trailer (none: [])."""
    raw = _value(trailing_metadata, STATUS_DETAILS_KEY)
    if not isinstance(raw, bytes):
        return []
    try:
        status = _RPC["google.rpc.Status"].FromString(raw)
    except DecodeError:  # a malformed trailer must not hide the status code itself
        return []
    return [(d.type_url.removeprefix(_TYPE_URL_PREFIX), bytes(d.value)) for d in status.details]


class InvalidArgumentError(RolloutError):
    """INVALID_ARGUMENT: the request breaks the contract; fix it, do not retry.

    `field_violations` lists the `google.rpc.BadRequest` violations: the field path in request
    terms (e.g. `sampling_params.top_p`, `sample.tokens[1]`) and what is wrong with it.
    """

    @property
    def field_violations(self) -> list[FieldViolation]:
        bad_request = self._detail("google.rpc.BadRequest")
        if bad_request is None:
            return []
        return [FieldViolation(v.field, v.description) for v in bad_request.field_violations]


class ResourceExhaustedError(RolloutError):
    """RESOURCE_EXHAUSTED: the replica's admission queue (or a limit) is full; retry later.

    `retry_after` is the server's hint in seconds: `google.rpc.RetryInfo.retry_delay`, else the
    `grpc-retry-pushback-ms` trailer, else None. The clients' default `RetryPolicy` already waited
    that long and retried before raising this.
    """

    @property
    def retry_after(self) -> float | None:
        return _retry_after(self._detail("google.rpc.RetryInfo"), self.trailing_metadata())


def _retry_after(retry_info: Any, trailing_metadata: Iterable[tuple[str, Any]] | None) -> float | None:
    if retry_info is not None and retry_info.HasField("retry_delay"):
        delay = retry_info.retry_delay
        return float(delay.seconds) + float(delay.nanos) / 1e9
    pushback = _value(trailing_metadata, PUSHBACK_KEY)
    try:
        return int(pushback) / 1000 if pushback is not None else None
    except (TypeError, ValueError):
        return None


class UnavailableError(RolloutError):
    """UNAVAILABLE: no engine could serve the call before any token (or the replica is going away,
    or the connection failed); retry with backoff, here or on another replica."""


class FailedPreconditionError(RolloutError):
    """FAILED_PRECONDITION: valid, but the fleet cannot serve it as deployed (e.g. routed experts
    asked of engines started without them); also a control call that no engine carried out."""


class NotFoundError(RolloutError):
    """NOT_FOUND: a named resource does not exist (e.g. `options.model` names no served model)."""


class PermissionDeniedError(RolloutError):
    """PERMISSION_DENIED: the token's role does not allow this call (e.g. a trainer's Abort(all))."""


class UnauthenticatedError(RolloutError):
    """UNAUTHENTICATED: no token, or one the replica does not know."""


class DeadlineExceededError(RolloutError):
    """DEADLINE_EXCEEDED: the call's deadline expired; nothing final was produced, generate again."""


class CancelledError(RolloutError):
    """CANCELLED: the call was cancelled (not `asyncio.CancelledError`, which is left as is)."""


class AbortedError(RolloutError):
    """ABORTED: gRPC's concurrency-conflict code. A generation stopped by `abort()` is not this: it
    ends normally with a sample whose status is SAMPLE_STATUS_ABORTED."""


class InternalError(RolloutError):
    """INTERNAL: a bug in the server (details only in its log) or in gRPC; report it."""


_CLASSES: dict[grpc.StatusCode, type[RolloutError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.INTERNAL: InternalError,
}


def _asked(error: grpc.RpcError, method: str) -> Any:
    """`error.method()`, or None: a bare `grpc.RpcError` has none of the `grpc.Call` methods."""
    getter = getattr(error, method, None)
    return getter() if callable(getter) else None


def _metadata(value: Any) -> grpc.aio.Metadata | None:
    if value is None or isinstance(value, grpc.aio.Metadata):
        return value
    return grpc.aio.Metadata(*((k, v) for k, v in value))


def rollout_error(error: grpc.RpcError) -> RolloutError:
    """The RolloutError subclass for a grpc error of either API (sync or asyncio)."""
    if isinstance(error, RolloutError):
        return error
    code = _asked(error, "code")
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return _CLASSES.get(code, RolloutError)(
        code,
        _metadata(_asked(error, "initial_metadata")),
        _metadata(_asked(error, "trailing_metadata")),
        _asked(error, "details"),
        _asked(error, "debug_error_string"),
    )


@contextlib.contextmanager
def raising_rollout_errors() -> Iterator[None]:
    """Re-raise grpc's errors of the calls made inside as RolloutError subclasses.

    `from None`: the new error carries all of grpc's (code, details, metadata, debug string), so
    the traceback shows the call that failed once instead of twice.
    """
    try:
        yield
    except RolloutError:
        raise
    except grpc.RpcError as error:
        raise rollout_error(error) from None


# ---- engine errors of control calls --------------------------------------------------------------

#: The control replies that list per-engine failures.
ControlResponse = TypeVar(
    "ControlResponse",
    pb.AbortResponse,
    pb.PauseResponse,
    pb.ResumeResponse,
    pb.ReleaseMemoryResponse,
    pb.ResumeMemoryResponse,
)
#: Any of them (what `EngineErrors.response` holds).
AnyControlResponse = (
    pb.AbortResponse
    | pb.PauseResponse
    | pb.ResumeResponse
    | pb.ReleaseMemoryResponse
    | pb.ResumeMemoryResponse
)


class EngineErrors(Exception):
    """Some engines did not do what a control call asked (the replica answered OK for the others).

    `response` is the full reply (which engines did it, and the others' reasons in
    `engine_errors`). Pass `raise_on_engine_errors=False` to the call to get the reply instead.
    When NO engine did it, the call fails with a `RolloutError` instead (`FailedPreconditionError`
    or `UnavailableError`). Not a `RolloutError` itself: the call succeeded, with an OK status.
    """

    def __init__(self, call: str, response: AnyControlResponse) -> None:
        self.response = response
        self.engine_errors: list[pb.EngineError] = list(response.engine_errors)
        reasons = "; ".join(f"{e.engine}: {e.error}" for e in self.engine_errors)
        super().__init__(f"{call}: {len(self.engine_errors)} engine(s) failed: {reasons}")


def check_engine_errors(
    call: str, response: ControlResponse, raise_on_engine_errors: bool
) -> ControlResponse:
    """Return `response`, or raise EngineErrors when it lists engine errors and raising is on."""
    if raise_on_engine_errors and response.engine_errors:
        raise EngineErrors(call, response)
    return response
