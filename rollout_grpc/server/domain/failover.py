"""The failover policy: what a generation does when an engine call fails. One pure function.

`decide` maps a `Situation` (what failed, how far the generation got, what is left) to a
`Decision`; `Rollout._run` only executes it. The rules, in order:

1. **Abort wins, and so does the caller's deadline.** Once the caller asked to abort, any failure
   (or the end of the bounded drain) finishes ABORTED with every token kept; the engine is not
   blamed. A generation whose caller's deadline is about to expire finishes the same way (the
   caller gets its tokens instead of DEADLINE_EXCEEDED).
2. **Rejected by the engine** (a caller error, HTTP 4xx or an in-stream 4xx event): before any
   token of this Generate it is raised (INVALID_ARGUMENT naming the field, or NOT_FOUND), exactly
   as the engine's own HTTP error would be; after tokens the sample ends FAILED with them kept.
3. **Media cache miss** (media sent by hash only, the engine no longer holds it): resend once to
   the same engine with the tensors; without tensors to send it is FAILED_PRECONDITION (render
   again) before tokens, FAILED after.
4. **No usable engine**: before any token, UNAVAILABLE — or FAILED_PRECONDITION when healthy
   engines failed this very request; after tokens, ABORTED with them kept (retryable later).
5. **Engine faults** (unreachable, broken or silent stream, internal error, malformed reply):
   retry elsewhere from the tokens produced so far, with the reduced budget. An internal error
   from an engine that still passes its health probe is the request's fault, not the engine's:
   it never opens the engine's circuit breaker, and after `max_request_failures` such failures
   the request ends (FAILED_PRECONDITION before tokens, FAILED after). Engines already tried are
   avoided while others are left; only engines at fault are excluded outright. A malformed reply does
   not open the breaker either (the engine serves other requests; its broken chunk is dropped
   whole and the continuation regenerates it). The budget running out ends TRUNCATED; the
   attempt limit ends ABORTED (engines lost) or FAILED (replies unusable), or UNAVAILABLE when
   nothing was produced. An engine the health probe declared dead while the call was silent is
   an engine fault like a hung stream (HUNG): failed over at once, not after the idle timeout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rollout_grpc.server.domain.model import Finish, Status


class CallFailure(enum.Enum):
    """What went wrong with one engine call (or with picking one)."""

    #: Connection refused, stream broken or closed before its end.
    UNAVAILABLE = "unavailable"
    #: The stream went silent and the engine failed its liveness probe.
    HUNG = "hung"
    #: An internal error, and the engine then failed its health probe: the engine is at fault.
    ENGINE_FAILED = "engine_failed"
    #: An internal error, but the engine still passes its health probe: the request is at fault.
    REQUEST_FAILED = "request_failed"
    #: The engine refused the request as invalid.
    REJECTED = "rejected"
    #: The reply cannot be parsed.
    MALFORMED = "malformed"
    #: Media sent by hash only is no longer cached by the engine.
    MEDIA_CACHE_MISS = "media_cache_miss"
    #: An abort was requested and the engine did not end the call within the drain bound.
    ABORT_DRAIN_EXPIRED = "abort_drain_expired"
    #: No usable engine is left to try.
    NO_ENGINE = "no_engine"
    #: The caller's deadline is about to expire: the sample goes back now, with its tokens.
    DEADLINE = "deadline"


class Action(enum.Enum):
    """What the generation loop does next."""

    RETRY_ELSEWHERE = "retry_elsewhere"
    RETRY_WITH_MEDIA = "retry_with_media"
    FINISH = "finish"
    RAISE = "raise"


class Raise(enum.Enum):
    """The domain error of a RAISE decision."""

    #: The engine's rejection: INVALID_ARGUMENT naming the field (NOT_FOUND for an unknown model).
    REJECTION = "rejection"
    UNAVAILABLE = "unavailable"
    FAILED_PRECONDITION = "failed_precondition"


@dataclass(frozen=True, slots=True)
class Situation:
    """Everything `decide` looks at."""

    failure: CallFailure
    #: Tokens produced by the failed engine call.
    tokens_this_call: int
    #: Tokens produced by this Generate so far (all of its engine calls).
    tokens_this_generate: int
    #: Engine calls made so far, the failed one included.
    attempts: int
    max_attempts: int
    #: Healthy engines that answered this request with an internal error, this one included.
    request_failures: int
    max_request_failures: int
    #: Tokens the sample may still produce (None = no limit).
    budget_left: int | None
    abort_requested: bool
    #: The media tensors were already resent after a cache miss.
    media_resent: bool = False
    #: Every media item carries its tensors (it can be resent).
    media_resendable: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do; FINISH carries the sample's finish and status, RAISE the error kind."""

    action: Action
    finish: Finish = Finish.UNSPECIFIED
    status: Status = Status.PENDING
    raise_as: Raise | None = None
    #: Report the engine to the pool as failed (opens its circuit breaker).
    mark_unhealthy: bool = False
    #: Do not try this engine again for this generation (engines already tried are only avoided).
    exclude_engine: bool = False
    reason: str = ""


#: Failures that are the engine's fault (its breaker opens).
_ENGINE_FAULTS = frozenset({CallFailure.UNAVAILABLE, CallFailure.HUNG, CallFailure.ENGINE_FAILED})
#: Failures where the engine answered but unusably: the sample ends FAILED when attempts run out.
_UNUSABLE = frozenset({CallFailure.REQUEST_FAILED, CallFailure.MALFORMED})


def _finish(
    finish: Finish,
    status: Status,
    reason: str = "",
    *,
    mark_unhealthy: bool = False,
    exclude_engine: bool = False,
) -> Decision:
    return Decision(
        Action.FINISH,
        finish,
        status,
        reason=reason,
        mark_unhealthy=mark_unhealthy,
        exclude_engine=exclude_engine,
    )


def _raise(
    kind: Raise, reason: str = "", *, mark_unhealthy: bool = False, exclude_engine: bool = False
) -> Decision:
    return Decision(
        Action.RAISE,
        raise_as=kind,
        reason=reason,
        mark_unhealthy=mark_unhealthy,
        exclude_engine=exclude_engine,
    )


def decide(s: Situation) -> Decision:
    """The next step after a failed engine call (see the module docstring for the rules)."""
    nothing_yet = s.tokens_this_generate == 0
    if s.abort_requested or s.failure is CallFailure.ABORT_DRAIN_EXPIRED:
        return _finish(Finish.ABORT, Status.ABORTED)
    if s.failure is CallFailure.DEADLINE:
        return _finish(Finish.ABORT, Status.ABORTED, "the caller's deadline is about to expire")
    if s.failure is CallFailure.REJECTED:
        if nothing_yet:
            return _raise(Raise.REJECTION)
        return _finish(Finish.ERROR, Status.FAILED, "the engine rejected the continuation")
    if s.failure is CallFailure.MEDIA_CACHE_MISS:
        return _media_cache_miss(s, nothing_yet)
    if s.failure is CallFailure.NO_ENGINE:
        return _no_engine(s, nothing_yet)
    return _engine_fault(s, nothing_yet)


def _media_cache_miss(s: Situation, nothing_yet: bool) -> Decision:
    if s.media_resendable and not s.media_resent:
        return Decision(Action.RETRY_WITH_MEDIA, reason="media cache miss: resending the tensors")
    reason = (
        "the engine no longer caches the sample's media and the sample carries no kwargs_data to "
        "resend: render the prompt again"
    )
    if nothing_yet:
        return _raise(Raise.FAILED_PRECONDITION, reason)
    return _finish(Finish.ERROR, Status.FAILED, reason)


def _no_engine(s: Situation, nothing_yet: bool) -> Decision:
    if nothing_yet and s.request_failures:
        return _raise(
            Raise.FAILED_PRECONDITION,
            f"{s.request_failures} healthy engine(s) failed this request with an internal error",
        )
    if nothing_yet:
        return _raise(Raise.UNAVAILABLE, "no healthy engine is available")
    return _finish(Finish.ABORT, Status.ABORTED, "no healthy engine is available")


def _engine_fault(s: Situation, nothing_yet: bool) -> Decision:
    blame = s.failure in _ENGINE_FAULTS
    if s.failure is CallFailure.REQUEST_FAILED and s.request_failures >= s.max_request_failures:
        reason = (
            f"{s.request_failures} healthy engine(s) failed this request with an internal error; "
            "the request itself is the likely cause"
        )
        if nothing_yet:
            return _raise(Raise.FAILED_PRECONDITION, reason)
        return _finish(Finish.ERROR, Status.FAILED, reason)
    if s.budget_left == 0:
        return _finish(Finish.LENGTH, Status.TRUNCATED, mark_unhealthy=blame)
    if s.attempts >= s.max_attempts:
        reason = f"gave up after {s.attempts} engine calls"
        if nothing_yet:
            return _raise(Raise.UNAVAILABLE, reason, mark_unhealthy=blame)
        status = Status.FAILED if s.failure in _UNUSABLE else Status.ABORTED
        finish = Finish.ERROR if status is Status.FAILED else Finish.ABORT
        return _finish(finish, status, reason, mark_unhealthy=blame)
    # Engines at fault are not tried again for this generation. After a malformed reply or a
    # request-specific error the engine stays allowed (the loop prefers engines not tried yet): one
    # bad chunk or one transient 500 must not end a sample on a one-engine fleet, and the attempt
    # and request-failure limits bound a persistent one.
    return Decision(
        Action.RETRY_ELSEWHERE, mark_unhealthy=blame, exclude_engine=blame, reason=s.failure.value
    )
