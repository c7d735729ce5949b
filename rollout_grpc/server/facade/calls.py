"""One record per call, whichever door it came through: what it asked, what it did, how it ended.

Both front doors open a `CallRecord` for every call they serve (`RolloutFacade.call`), before
authentication, so a call refused at the door is recorded like one that generated. The facade
fills in what the domain did (the final sample, the first token's time, the control result), the
admission queue wait arrives through `CURRENT_CALL` (`TimedAdmission`), and when the call ends
the record goes to the listeners: the log line (`log_call`: `generate_done` for the Generate RPC,
`openai_done` for the front door) and the Prometheus metrics (`observe.metrics.Metrics.observe`).

Outcomes are named with the canonical status codes (`OK`, `INVALID_ARGUMENT`, `CANCELLED`, ...,
the names gRPC uses), whatever the door: the front door adds its HTTP status.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollout_grpc.server.domain.model import Sample
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.inflight import InFlight

log = structlog.get_logger("rollout_grpc.server.calls")
openai_log = structlog.get_logger("rollout_grpc.server.front.openai.calls")


class Door(enum.StrEnum):
    """Which front door a call came through."""

    GRPC = "grpc"
    OPENAI = "openai"


@dataclass(slots=True)
class CallRecord:
    """What one call did, in domain terms (no protobuf, no HTTP objects)."""

    door: Door
    #: The RPC name (`Generate`, `Abort`, ...) or the front door's route (`/v1/chat/completions`).
    method: str
    started: float = field(default_factory=time.monotonic)
    ended: float = 0.0
    #: The canonical status code name of the outcome (`OK` until the call fails).
    code: str = "OK"
    #: The error message of a call that failed.
    details: str = ""
    #: The front door's HTTP status (None on the gRPC door).
    http_status: int | None = None
    #: Identity of the authenticated caller (None before authentication, or when it refused).
    caller: str | None = None
    request_id: str | None = None
    session_id: str | None = None
    sample_index: int = 0
    group_index: int = 0
    #: Whether the caller asked for streamed tokens (the front door's `stream`).
    stream: bool = False
    #: Seconds from the call's start to the first generated token; None without one.
    ttft_s: float | None = None
    #: Seconds the generation waited for an admission slot; None if it never asked.
    queue_wait_s: float | None = None
    #: The final sample of a generation, None when the call ended without one.
    sample: Sample | None = None
    #: Response tokens and engine attempts the sample had before this call (a continuation).
    prior_response_length: int = 0
    prior_attempts: int = 0
    #: Prompt tokens of a front-door turn (its new tokens are the rest of the sample).
    prompt_tokens: int | None = None
    #: What a control call did (`AbortResult`, `FleetResult`), for the metrics.
    result: object = None
    #: The target of an Abort (`all`, `request_ids`, `session_id`, `group_index`).
    abort_target: str | None = None
    #: RolloutStep: groups that ended, by outcome; the weight-version lag of every accepted
    #: sample; response tokens the step generated.
    step_groups: dict[str, int] = field(default_factory=dict)
    version_lags: list[int] = field(default_factory=list)
    step_tokens: int = 0
    #: Write the call's log line. Off for calls refused past a peer's budget of failed
    #: authentications (security/refusals.py): counted in the metrics, not one line each.
    log_line: bool = True

    @property
    def duration_s(self) -> float:
        """Seconds from start to end."""
        return self.ended - self.started

    @property
    def new_tokens(self) -> int:
        """Tokens this call generated (a continued sample already had some)."""
        if self.sample is None:
            return 0
        if self.prompt_tokens is not None:
            return max(0, self.sample.token_count - self.prompt_tokens)
        return max(0, self.sample.response_length - self.prior_response_length)

    @property
    def engines(self) -> list[str]:
        """The engines this call's generation ran on, in order (earlier calls excluded)."""
        if self.sample is None:
            return []
        return [a.engine for a in self.sample.engine_attempts[self.prior_attempts :]]

    @property
    def weight_versions(self) -> list[str]:
        """Weight versions of the tokens this call generated, in order, without repeats."""
        if self.sample is None:
            return []
        start = self.prior_response_length if self.prompt_tokens is None else 0
        return list(dict.fromkeys(s.version for s in self.sample.weight_versions if s.end > start))

    @property
    def status(self) -> str:
        """The final sample's status name, or the outcome's code when there was no sample."""
        return self.sample.status.name if self.sample is not None else self.code

    def mark_token(self) -> None:
        """Record the first generated token's time (later calls keep the first)."""
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.started


Listener = Callable[[CallRecord], None]

#: The canonical code of an HTTP status (the front door's outcome, in the gRPC door's terms).
_HTTP_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    408: "DEADLINE_EXCEEDED",
    409: "FAILED_PRECONDITION",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def http_code_name(status: int) -> str:
    """The canonical code name of an HTTP status: `OK` below 400, `INTERNAL` for unknown 5xx."""
    if status < 400:
        return "OK"
    return _HTTP_CODES.get(status, "INVALID_ARGUMENT" if status < 500 else "INTERNAL")


#: The record of the call the current task serves (set by the door that opened it).
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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def log_call(record: CallRecord) -> None:
    """The one log line of every generation that ends, whatever its outcome and door (unless the
    call was one of a flood of failed authentications, `CallRecord.log_line`)."""
    if not record.log_line:
        return
    if record.door is Door.OPENAI:
        _log_front_door(record)
    elif record.method == "Generate":
        _log_generate(record)
    elif record.method == "RolloutStep":
        _log_step(record)


def _log_step(record: CallRecord) -> None:
    """`rollout_step_done`: the step id, its groups by outcome, tokens, the worst lag, the end."""
    fields: dict[str, object] = {
        "step_id": record.request_id,
        "code": record.code,
        "groups": record.step_groups,
        "new_tokens": record.step_tokens,
        "max_version_lag": max(record.version_lags, default=0),
        "latency_ms": _ms(record.duration_s),
    }
    summary = record.result
    reason = getattr(summary, "reason", None)
    if reason:
        fields["reason"] = reason
    if record.details:
        fields["error"] = record.details
    log.info("rollout_step_done", **fields)


def _enabled(logger: Any, level: int) -> bool:
    """Whether `logger` writes lines of `level`: the fields of a line that would be dropped are
    not built (a replica logging warnings only built them for every successful call, ~20 us each;
    the fourteenth pass in bench/profile_notes.md). A logger without the check writes."""
    check = getattr(logger, "is_enabled_for", None)
    return True if check is None else bool(check(level))


def _log_generate(record: CallRecord) -> None:
    sample = record.sample
    ok = record.code == "OK" and sample is not None
    if not _enabled(log, logging.INFO if ok else logging.WARNING):
        return
    fields: dict[str, object] = {
        "request_id": record.request_id,
        "sample_index": record.sample_index,
        "group_index": record.group_index,
        "session_id": record.session_id or None,
        "status": record.status,
        "code": record.code,
        "engines": record.engines,
        "weight_versions": record.weight_versions,
        "new_tokens": record.new_tokens,
        "queue_wait_ms": _ms(record.queue_wait_s),
        "ttft_ms": _ms(record.ttft_s),
        "latency_ms": _ms(record.duration_s),
    }
    if sample is not None:
        fields["finish"] = sample.finish_reason.name
        if sample.failure_reason:
            fields["failure"] = sample.failure_reason
        failovers = max(0, len(record.engines) - 1)
        if failovers:
            fields["failovers"] = failovers
    elif record.details:
        fields["error"] = record.details
    if ok:
        log.info("generate_done", **fields)
    else:
        log.warning("generate_done", **fields)


def _log_front_door(record: CallRecord) -> None:
    sample = record.sample
    code = record.http_status or 200
    fields: dict[str, object] = {
        "route": record.method,
        "code": code,
        "caller": record.caller,
        "session_id": record.session_id,
        "request_id": record.request_id,
        "stream": record.stream,
        "new_tokens": record.new_tokens,
        "queue_wait_ms": _ms(record.queue_wait_s),
        "ttft_ms": _ms(record.ttft_s),
        "latency_ms": _ms(record.duration_s),
    }
    if sample is not None:
        fields["status"] = sample.status.name
        fields["finish"] = sample.finish_reason.name
        fields["engines"] = record.engines
        fields["weight_versions"] = record.weight_versions
        if sample.failure_reason:
            fields["failure"] = sample.failure_reason
    if record.details:
        fields["error"] = record.details
    if code < 400 and (sample is None or not sample.failure_reason):
        openai_log.info("openai_done", **fields)
    else:
        openai_log.warning("openai_done", **fields)
