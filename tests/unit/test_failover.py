"""The failover policy as a table: one row per situation a generation meets, with the decision."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_grpc.server.domain.failover import Action, CallFailure, Decision, Raise, Situation, decide
from rollout_grpc.server.domain.model import Finish, Status

F = CallFailure


def situation(failure: CallFailure, **kw: Any) -> Situation:
    base: dict[str, Any] = {
        "tokens_this_call": 0,
        "tokens_this_generate": 0,
        "attempts": 1,
        "max_attempts": 4,
        "request_failures": 0,
        "max_request_failures": 2,
        "budget_left": 100,
        "abort_requested": False,
    }
    base.update(kw)
    return Situation(failure=failure, **base)


RETRY = Action.RETRY_ELSEWHERE
FINISH = Action.FINISH
RAISE = Action.RAISE

#: (id, situation, action, (finish, status) or raise kind, breaker opens, engine never tried again)
TABLE: list[tuple[str, Situation, Action, Any, bool, bool]] = [
    # Mid-stream drop / refused connection: the engine's fault; continue elsewhere.
    (
        "mid-stream drop",
        situation(F.UNAVAILABLE, tokens_this_call=5, tokens_this_generate=5),
        RETRY,
        None,
        True,
        True,
    ),
    ("refused before tokens", situation(F.UNAVAILABLE), RETRY, None, True, True),
    ("hung engine", situation(F.HUNG, tokens_this_call=3, tokens_this_generate=3), RETRY, None, True, True),
    # 5xx before the first token: engine-wide (health probe fails) vs request-specific (engine healthy).
    ("5xx engine-wide", situation(F.ENGINE_FAILED), RETRY, None, True, True),
    (
        "5xx request-specific, first engine",
        situation(F.REQUEST_FAILED, request_failures=1),
        RETRY,
        None,
        False,
        False,
    ),
    (
        "5xx request-specific on N engines",
        situation(F.REQUEST_FAILED, attempts=2, request_failures=2),
        RAISE,
        Raise.FAILED_PRECONDITION,
        False,
        False,
    ),
    (
        "5xx request-specific on N engines after tokens",
        situation(F.REQUEST_FAILED, attempts=3, request_failures=2, tokens_this_generate=7),
        FINISH,
        (Finish.ERROR, Status.FAILED),
        False,
        False,
    ),
    (
        "in-stream 5xx after tokens",
        situation(F.REQUEST_FAILED, request_failures=1, tokens_this_call=4, tokens_this_generate=4),
        RETRY,
        None,
        False,
        False,
    ),
    # Media cache miss: resend the tensors once to the same engine.
    (
        "cache miss with kwargs",
        situation(F.MEDIA_CACHE_MISS, media_resendable=True),
        Action.RETRY_WITH_MEDIA,
        None,
        False,
        False,
    ),
    (
        "cache miss without kwargs",
        situation(F.MEDIA_CACHE_MISS, media_resendable=False),
        RAISE,
        Raise.FAILED_PRECONDITION,
        False,
        False,
    ),
    (
        "cache miss again after resending",
        situation(F.MEDIA_CACHE_MISS, media_resendable=True, media_resent=True),
        RAISE,
        Raise.FAILED_PRECONDITION,
        False,
        False,
    ),
    (
        "cache miss without kwargs after tokens",
        situation(F.MEDIA_CACHE_MISS, tokens_this_generate=3),
        FINISH,
        (Finish.ERROR, Status.FAILED),
        False,
        False,
    ),
    # Rejections (HTTP 4xx or in-stream 4xx event): the caller's error.
    ("4xx before tokens", situation(F.REJECTED), RAISE, Raise.REJECTION, False, False),
    ("in-stream 4xx before tokens", situation(F.REJECTED, attempts=1), RAISE, Raise.REJECTION, False, False),
    (
        "in-stream 4xx after tokens",
        situation(F.REJECTED, tokens_this_call=2, tokens_this_generate=2),
        FINISH,
        (Finish.ERROR, Status.FAILED),
        False,
        False,
    ),
    (
        "rejected continuation after a failover",
        situation(F.REJECTED, attempts=2, tokens_this_generate=6),
        FINISH,
        (Finish.ERROR, Status.FAILED),
        False,
        False,
    ),
    # Malformed replies: never INTERNAL; retried (any engine), tokens kept; FAILED at the limit.
    (
        "malformed reply",
        situation(F.MALFORMED, tokens_this_call=2, tokens_this_generate=2),
        RETRY,
        None,
        False,
        False,
    ),
    (
        "malformed at the attempt limit",
        situation(F.MALFORMED, attempts=4, tokens_this_generate=9),
        FINISH,
        (Finish.ERROR, Status.FAILED),
        False,
        False,
    ),
    (
        "malformed at the limit, nothing yet",
        situation(F.MALFORMED, attempts=4),
        RAISE,
        Raise.UNAVAILABLE,
        False,
        False,
    ),
    # Limits.
    (
        "max attempts after tokens",
        situation(F.UNAVAILABLE, attempts=4, tokens_this_generate=9),
        FINISH,
        (Finish.ABORT, Status.ABORTED),
        True,
        False,
    ),
    (
        "max attempts, nothing yet",
        situation(F.UNAVAILABLE, attempts=4),
        RAISE,
        Raise.UNAVAILABLE,
        True,
        False,
    ),
    (
        "budget exhausted by the dropped call",
        situation(F.UNAVAILABLE, tokens_this_call=5, tokens_this_generate=5, budget_left=0),
        FINISH,
        (Finish.LENGTH, Status.TRUNCATED),
        True,
        False,
    ),
    # Abort wins over everything, tokens kept, engine not blamed.
    (
        "abort during failover",
        situation(F.UNAVAILABLE, tokens_this_generate=4, abort_requested=True),
        FINISH,
        (Finish.ABORT, Status.ABORTED),
        False,
        False,
    ),
    (
        "abort drain expired",
        situation(F.ABORT_DRAIN_EXPIRED, tokens_this_generate=4, abort_requested=True),
        FINISH,
        (Finish.ABORT, Status.ABORTED),
        False,
        False,
    ),
    # The caller's deadline is about to expire: the sample goes back with its tokens, and the
    # engine is not blamed (it may be merely slow), also before any token and with attempts left.
    (
        "caller's deadline near, mid-stream",
        situation(F.DEADLINE, tokens_this_call=7, tokens_this_generate=7),
        FINISH,
        (Finish.ABORT, Status.ABORTED),
        False,
        False,
    ),
    (
        "caller's deadline near, before any token",
        situation(F.DEADLINE),
        FINISH,
        (Finish.ABORT, Status.ABORTED),
        False,
        False,
    ),
    (
        "abort before any token",
        situation(F.REJECTED, abort_requested=True),
        FINISH,
        (Finish.ABORT, Status.ABORTED),
        False,
        False,
    ),
    # No engine at all.
    (
        "no engine before any token",
        situation(F.NO_ENGINE, attempts=0),
        RAISE,
        Raise.UNAVAILABLE,
        False,
        False,
    ),
    (
        "every engine died before any token",
        situation(F.NO_ENGINE, attempts=2),
        RAISE,
        Raise.UNAVAILABLE,
        False,
        False,
    ),
    (
        "no engine after tokens",
        situation(F.NO_ENGINE, tokens_this_generate=3),
        FINISH,
        (Finish.ABORT, Status.ABORTED),
        False,
        False,
    ),
    (
        "no engine left after request-specific failures",
        situation(F.NO_ENGINE, request_failures=1),
        RAISE,
        Raise.FAILED_PRECONDITION,
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    ("situation_", "action", "outcome", "breaker", "excluded"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_policy_table(
    situation_: Situation, action: Action, outcome: Any, breaker: bool, excluded: bool
) -> None:
    decision: Decision = decide(situation_)
    assert decision.action is action
    if action is FINISH:
        assert (decision.finish, decision.status) == outcome
    if action is RAISE:
        assert decision.raise_as is outcome
    assert decision.mark_unhealthy is breaker
    assert decision.exclude_engine is excluded


def test_every_failure_kind_is_in_the_table() -> None:
    assert {row[1].failure for row in TABLE} == set(CallFailure)
