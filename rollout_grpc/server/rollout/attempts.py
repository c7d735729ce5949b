"""The attempt loop of one Generate: pick an engine, call it, and on failure do what
`failover.decide` says (one table of rules): retry elsewhere, resend the media, finish the sample,
or raise a domain error.

The engine call itself is `engine_call.py`; the state both read is `run_state.py`. A failure after
tokens were produced never raises: the sample comes back ABORTED (engines lost) or FAILED
(unusable reply) with everything generated so far, and a failover continues from those tokens
with the reduced budget (partial-rollout continuation).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import structlog

from rollout_grpc.server.domain import failover, multimodal, sample_ops
from rollout_grpc.server.domain import params as params_mod
from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from rollout_grpc.server.domain.failover import Action, CallFailure, Decision, Raise, Situation
from rollout_grpc.server.domain.model import Finish, Status, TokenBatch, WeightSpan
from rollout_grpc.server.engines.api import (
    EngineError,
    EngineHung,
    EngineMalformed,
    EngineRejected,
    EngineRequestFailed,
    MediaCacheMiss,
)
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout.cancellation import DrainExpired, Interrupted
from rollout_grpc.server.rollout.config import RolloutConfig
from rollout_grpc.server.rollout.engine_call import EngineCaller
from rollout_grpc.server.rollout.inflight import InFlight
from rollout_grpc.server.rollout.run_state import Attempt, GenerateRun

log = structlog.get_logger(__name__)

#: Version label for tokens whose engine died before reporting their weight version.
UNKNOWN_VERSION = "unknown"


class AttemptLoop:
    """The engine calls of each Generate, over one engine pool."""

    def __init__(self, pool: EnginePool, config: RolloutConfig, caller: EngineCaller) -> None:
        self.pool = pool
        self.config = config
        self.caller = caller

    async def run(self, run: GenerateRun) -> AsyncIterator[TokenBatch]:
        """The engine calls of one generation: call, and on failure do what `failover.decide` says."""
        sample, entry, deadline = run.sample, run.entry, run.deadline
        while not entry.abort_requested and not deadline.abort_due:
            engine = self._pick(run)
            run.decision, run.error = None, None
            if engine is None:
                budget = sample_ops.remaining_budget(sample, run.params)
                run.decision = _decide(self._situation(CallFailure.NO_ENGINE, run, 0, budget), entry)
            else:
                # One engine call, inline (not a generator re-yielding its batches: each streamed
                # message resumes every generator of the chain, bench/profile_notes.md, twelfth
                # pass); on failure `run.decision` says what next (None: the call succeeded).
                if not sample.token_count:
                    await _render_prompt(run, engine)
                attempt = Attempt.start(run, engine)
                failure: CallFailure | None = None
                try:
                    with self.pool.lease(engine):
                        async for batch in self.caller.stream(attempt):
                            yield batch
                    self.pool.report_success(engine)
                except (EngineError, DrainExpired, Interrupted) as exc:
                    failure = await self._note_failure(run, attempt, exc)
                finally:
                    attempt.record.end = sample.response_length
                if failure is not None:
                    self._after_failure(run, attempt, failure)
            if self._ended(run, engine):
                break
        else:
            reason = "" if entry.abort_requested else deadline.reason
            sample_ops.finish(sample, Finish.ABORT, Status.ABORTED, reason)
        last = run.batcher.flush()
        if last is not None:
            yield last

    def _ended(self, run: GenerateRun, engine: EngineHandle | None) -> bool:
        """After an engine call (or none to call): True when the generation ends here; raises the
        domain error of a RAISE decision."""
        decision = run.decision
        if decision is None:
            _blame_the_deadline(run)
            return True  # the call ended normally
        if decision.action is Action.RAISE:
            unusable = self.pool.unusable_reasons() if engine is None else []
            raise _domain_error(decision, run.error, unusable) from run.error
        if decision.action is Action.FINISH:
            sample_ops.finish(run.sample, decision.finish, decision.status, decision.reason)
            return True
        run.media_resent = run.media_resent or decision.action is Action.RETRY_WITH_MEDIA
        return False

    async def _note_failure(self, run: GenerateRun, attempt: Attempt, exc: BaseException) -> CallFailure:
        """A failed engine call's kind, noted in `run.error` and the call's record."""
        run.error = exc if isinstance(exc, EngineError) else None
        failure = await self._classify(attempt.engine, exc)
        attempt.record.error = f"{failure.value}: {exc}"
        return failure

    def _after_failure(self, run: GenerateRun, attempt: Attempt, failure: CallFailure) -> None:
        """What `failover.decide` says after a failed call, in `run.decision`; the engine's
        health and exclusion as it says."""
        engine = attempt.engine
        if failure is CallFailure.REQUEST_FAILED:
            run.request_failures += 1
        _label_orphans(attempt)
        situation = self._situation(failure, run, attempt.tokens, attempt.budget_left)
        run.decision = decision = _decide(situation, run.entry)
        if decision.mark_unhealthy:
            self.pool.report_failure(engine, attempt.record.error)
        if decision.exclude_engine:
            run.excluded.add(engine.url)

    def _situation(
        self, failure: CallFailure, run: GenerateRun, tokens_this_call: int, budget_left: int | None
    ) -> Situation:
        """What the failover policy decides from (`budget_left`: what remains of the budget)."""
        features = run.sample.features
        return Situation(
            failure=failure,
            tokens_this_call=tokens_this_call,
            tokens_this_generate=run.tokens_this_generate,
            attempts=run.attempts,
            max_attempts=self.config.max_engine_attempts,
            request_failures=run.request_failures,
            max_request_failures=self.config.max_request_failures,
            budget_left=budget_left,
            abort_requested=run.entry.abort_requested,
            media_resent=run.media_resent,
            media_resendable=features is not None and multimodal.has_all_kwargs(features),
        )

    async def _classify(self, engine: EngineHandle, exc: BaseException) -> CallFailure:
        """The policy's name for an engine call's failure; an internal error asks the engine's health."""
        if isinstance(exc, DrainExpired):
            return CallFailure.ABORT_DRAIN_EXPIRED
        if isinstance(exc, Interrupted):  # only the caller's deadline gets here (see `engine_call`)
            return CallFailure.DEADLINE
        if isinstance(exc, EngineHung):
            return CallFailure.HUNG
        if isinstance(exc, EngineRejected):
            return CallFailure.REJECTED
        if isinstance(exc, MediaCacheMiss):
            return CallFailure.MEDIA_CACHE_MISS
        if isinstance(exc, EngineMalformed):
            return CallFailure.MALFORMED
        if isinstance(exc, EngineRequestFailed):
            healthy = await engine.client.health(self.config.health_probe_s)
            return CallFailure.REQUEST_FAILED if healthy else CallFailure.ENGINE_FAILED
        return CallFailure.UNAVAILABLE

    def _pick(self, run: GenerateRun) -> EngineHandle | None:
        """The engine for the next call: usable, not at fault, untried while others remain, and
        able to return routed experts when they are asked for.

        R3 from engines that cannot return it (dense model, MoE without the flag; known from the
        capability check) is refused with FAILED_PRECONDITION naming each engine and its reason
        before anything is generated. After tokens of this Generate, the failover policy decides as
        for no engine at all (the sample keeps its tokens).
        """
        avoid = set(run.excluded)
        if run.options.return_routed_experts:
            unable = self._unable_to_route(run.excluded)
            produced = run.tokens_this_generate > 0
            if unable and not produced and len(unable) == self._usable_count(run.excluded):
                raise FailedPrecondition(
                    "return_routed_experts: no usable engine can return routed experts: "
                    + "; ".join(unable.values())
                )
            avoid |= unable.keys()
        session = run.sample.session_id
        return self.pool.pick(session, exclude=avoid | run.tried) or self.pool.pick(session, exclude=avoid)

    def _unable_to_route(self, excluded: set[str]) -> dict[str, str]:
        """Usable engines (not at fault) that cannot return routed experts -> why."""
        unable: dict[str, str] = {}
        for engine in self.pool.engines:
            if engine.usable and engine.url not in excluded and engine.capabilities is not None:
                problem = engine.capabilities.routed_experts_problem(engine.url)
                if problem is not None:
                    unable[engine.url] = problem
        return unable

    def _usable_count(self, excluded: set[str]) -> int:
        return sum(1 for e in self.pool.engines if e.usable and e.url not in excluded)


async def _render_prompt(run: GenerateRun, engine: EngineHandle) -> None:
    """Turn a prompt text into ids with the engine's tokenizer (the service loads none)."""
    sample = run.sample
    try:
        rendered = await engine.client.render_text(sample.prompt or "", run.options.model)
    except EngineRejected as exc:
        raise _rejection(exc, default_field="sample.prompt") from exc
    except EngineError as exc:
        raise Unavailable(f"could not render the prompt: {exc.message}") from exc
    if not rendered.token_ids:
        raise InvalidArgument("sample.prompt", "the engine rendered the prompt to no tokens")
    sample.prompt_ids = tuple(rendered.token_ids)


def _label_orphans(attempt: Attempt) -> None:
    """Give tokens of a broken engine call a weight-version span (the engine's last known one)."""
    sample = attempt.run.sample
    covered = sample.weight_versions[-1].end if sample.weight_versions else 0
    start = max(covered, attempt.record.start)
    if sample.response_length > start:
        version = attempt.engine.weight_version or UNKNOWN_VERSION
        sample_ops.add_weight_spans(sample, [WeightSpan(version, 0, sample.response_length - start)], start)


def _blame_the_deadline(run: GenerateRun) -> None:
    """An engine call that ended ABORTED after the deadline's upstream abort (and no one else's)
    says why, as a sample ended at the stop point does."""
    ours = run.deadline.abort_due and not run.entry.abort_requested
    if ours and run.sample.status is Status.ABORTED and not run.sample.failure_reason:
        run.sample.failure_reason = run.deadline.reason


#: Decisions that make another engine call.
_RETRIES = frozenset({Action.RETRY_ELSEWHERE, Action.RETRY_WITH_MEDIA})


def _decide(situation: Situation, entry: InFlight) -> Decision:
    """`failover.decide`, with one `failover` log line per decision: at warning level when the
    sample moves on to another engine call (an operator wants to see those), at debug otherwise."""
    decision = failover.decide(situation)
    emit = log.warning if decision.action in _RETRIES else log.debug
    emit(
        "failover",
        request_id=entry.request_id,
        failure=situation.failure.value,
        action=decision.action.value,
        reason=decision.reason,
        tokens_this_call=situation.tokens_this_call,
        tokens_so_far=situation.tokens_this_generate,
        attempts=situation.attempts,
    )
    return decision


def _rejection(exc: EngineRejected, default_field: str = "sample.tokens") -> Exception:
    """An engine rejection before any token was produced, as a domain error naming our field."""
    if exc.not_found:
        return NotFound(f"engine {exc.url}: {exc.message}")
    field_name = params_mod.field_for_engine_param(exc.param, default_field)
    return InvalidArgument(field_name, f"rejected by the engine: {exc.message}")


def _domain_error(
    decision: Decision, error: EngineError | None, unusable: list[tuple[str, str]] | None = None
) -> Exception:
    """The domain error of a RAISE decision; with no engine to pick, it names every engine and why
    it receives no generations (`unusable`)."""
    if decision.raise_as is Raise.REJECTION and isinstance(error, EngineRejected):
        return _rejection(error)
    detail = f": {error.message}" if error is not None else ""
    if unusable:
        detail += " (" + "; ".join(f"{url}: {why}" for url, why in unusable) + ")"
    if decision.raise_as is Raise.FAILED_PRECONDITION:
        return FailedPrecondition(f"{decision.reason}{detail}")
    return Unavailable(f"{decision.reason}{detail}")
