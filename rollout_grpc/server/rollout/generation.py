"""One sample's generation: the domain logic of slime/vime `generate()` on inference engines.

`Rollout.generate` is an async generator: it yields `TokenBatch`es as tokens arrive and, last, the
final `Sample`. It owns budget, continuation, masks, status, weight versions, routed experts and
failover; it knows nothing about gRPC, and engines only through `engine_api.EngineAdapter`. What
happens after a failed engine call is decided by `failover.decide` (one table of rules). Guarantees:

* every token yielded in a batch is in the final sample, and vice versa (no loss, no duplicates);
* a failure after tokens were produced never raises: the sample comes back ABORTED (engines lost)
  or FAILED (unusable reply) with everything generated so far;
* when an engine dies or its stream breaks, the sample continues on another healthy engine from
  the tokens already produced, with the reduced budget (partial-rollout continuation);
* leaving early (client cancel, deadline) closes the upstream HTTP request, which makes vLLM
  abort the engine-side generation;
* an abort ends the generation within `RolloutConfig.abort_drain_s` of the request, even if its
  engine never answers again (a caller busy with its own await then, e.g. a gRPC write under flow
  control, is never cancelled: the generation ends at its next read of the engine);
* a stream on an engine that a health probe finds dead (while the stream was silent) fails over
  at once, not after the adapter's idle timeout (`EngineHandle.watch`);
* a caller's deadline (`GenerateOptions.deadline`) is met with the sample: shortly before it the
  engine call is aborted upstream, so the engine's final chunk brings every token it made, and
  by `bounds.deadline_margin_s` before it the generation ends ABORTED with every token received
  (`deadline.py`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollout_grpc.server.domain import bounds, failover, multimodal, routed_experts, sample_ops
from rollout_grpc.server.domain import params as params_mod
from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from rollout_grpc.server.domain.failover import Action, CallFailure, Decision, Raise, Situation
from rollout_grpc.server.domain.identity import current_caller
from rollout_grpc.server.domain.model import (
    EngineAttempt,
    Finish,
    GenerateOptions,
    Sample,
    SamplingParams,
    Status,
    TokenBatch,
    WeightSpan,
)
from rollout_grpc.server.engines.api import (
    EngineCall,
    EngineDelta,
    EngineError,
    EngineFinal,
    EngineHung,
    EngineMalformed,
    EngineRejected,
    EngineRequestFailed,
    EngineUnavailable,
    EngineUsage,
    FinishKind,
    MediaCacheMiss,
)
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.call_ids import CallIds
from rollout_grpc.server.rollout.deadline import CallerDeadline
from rollout_grpc.server.rollout.inflight import AbortedWhileQueued, InFlight, InFlightRegistry
from rollout_grpc.server.rollout.owner_abort import OwnerAborts

log = structlog.get_logger(__name__)

#: Version label for tokens whose engine died before reporting their weight version.
UNKNOWN_VERSION = "unknown"


@dataclass(slots=True)
class RolloutConfig:
    """Knobs of the generation loop."""

    #: Engine calls per Generate (the first plus failovers).
    max_engine_attempts: int = 4
    #: Ask engines to batch tokens into fewer SSE events (vLLM's `stream_interval`). Every SSE
    #: event costs the service 25-50 us of CPU however few tokens it holds (bench/profile_notes.md),
    #: so batching upstream is the largest saving. Turn off for engines that reject it.
    engine_stream_interval: bool = True
    #: `stream_interval` for callers that want no deltas (`final_only`).
    final_only_stream_interval: int = 64
    #: Healthy engines that may fail the same request with an internal error before the request,
    #: not the engines, is held at fault (FAILED_PRECONDITION; no circuit breaker opens).
    max_request_failures: int = 2
    #: After an abort was requested, seconds to wait for the engine's final chunk before the
    #: generation ends ABORTED with what it has (an engine that never answers cannot hold it).
    abort_drain_s: float = 1.0
    #: Seconds the health probe that tells an engine-wide from a request-specific failure may take.
    health_probe_s: float = 2.0
    #: Most seconds before a caller's deadline that its sample is sent (10 % of the caller's time
    #: when that is less): see `bounds.deadline_margin_s`.
    deadline_margin_s: float = bounds.DEADLINE_MARGIN_S
    #: Most seconds before that the engine call is aborted upstream, so that the engine's final
    #: chunk arrives in time: see `bounds.deadline_abort_lead_s` and `deadline.py`.
    deadline_abort_lead_s: float = bounds.DEADLINE_ABORT_LEAD_S


class _Batcher:
    """Groups new tokens into stream messages: flush at N tokens or when the oldest is T old.

    With a time flush (T > 0) the first tokens of a generation go out at once, so the time to the
    first token is the engine's, not the batching delay (measured: TTFT p50 93-99 ms -> 15-23 ms at
    20 ms/token, bench/profile_notes.md). The age is checked as tokens arrive (no timer task).
    When the engine batches tokens into events (`stream_interval` > 1, `engine_batches`), the
    oldest token of an event was made just after the previous event arrived, so a batch's age
    counts from then; an event that spans the time flush is sent as it arrives.
    """

    __slots__ = (
        "_batched",
        "_first",
        "_interval",
        "_last",
        "_limit",
        "_logprobs",
        "_offset",
        "_since",
        "_text",
        "_tokens",
        "enabled",
    )

    def __init__(self, options: GenerateOptions) -> None:
        self.enabled = not options.final_only
        self._limit = max(1, options.stream_batch_tokens)
        self._interval = options.stream_batch_interval_s
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._text = ""
        self._offset = 0
        self._since = 0.0
        self._first = self._interval > 0
        #: The engine call batches tokens into events; when its last event (or the call) came.
        self._batched = False
        self._last = 0.0

    def engine_batches(self, stream_interval: int) -> None:
        """An engine call starts that sends `stream_interval` tokens per event."""
        self._batched = stream_interval > 1
        self._last = time.monotonic()

    def _open(self, offset: int, now: float) -> None:
        """Start a batch at response position `offset` unless one is pending."""
        if not self._tokens and not self._text:
            self._offset = offset
            self._since = self._last if self._batched else now

    def add(self, offset: int, tokens: list[int], logprobs: list[float], text: str) -> TokenBatch | None:
        if not self.enabled:
            return None
        now = time.monotonic()
        pending = bool(self._tokens or self._text)
        self._open(offset, now)
        self._last = now
        if (
            self._first
            or len(tokens) + len(self._tokens) >= self._limit
            or (self._interval > 0 and now - self._since >= self._interval)
        ):
            self._first = False
            if not pending:
                # The usual case once the engine sends a message's tokens per event: the event is
                # the message, sent without copying it into the batch first.
                return TokenBatch(tokens, logprobs, offset, text)
            self._tokens.extend(tokens)
            self._logprobs.extend(logprobs)
            self._text += text
            return self.flush()
        self._tokens.extend(tokens)
        self._logprobs.extend(logprobs)
        self._text += text
        return None

    def add_text(self, offset: int, text: str) -> None:
        """Text that arrived without tokens (e.g. held back by a stop string until the end)."""
        if self.enabled:
            now = time.monotonic()
            self._open(offset, now)
            self._last = now
            self._text += text

    def flush(self) -> TokenBatch | None:
        if not self.enabled or (not self._tokens and not self._text):
            return None
        batch = TokenBatch(self._tokens, self._logprobs, self._offset, self._text)
        self._tokens, self._logprobs, self._text = [], [], ""
        return batch


def tokens_per_message(limit: int, interval_s: float, gap_s: float | None) -> int:
    """The tokens an engine making one every `gap_s` seconds should send per SSE event
    (`stream_interval`): one event is then one stream message.

    The tokens made in two time flushes, at most `limit`. Such an event spans the time flush when
    it arrives (the batcher counts a batched event's age from the event before it, when its oldest
    token was made: `_Batcher.engine_batches`), so it is sent at once: messages at most ~2x
    `interval_s` apart, from one SSE event each (each event and each message cost the service
    25-200 us, bench/profile_notes.md). Twice, not once: an event of the tokens made within one
    flush arrives just before the flush is due and waits for the next, so the message carries two
    events at the same ~2x cadence. The limit caps it: an engine is never asked for more than a
    message holds. The old rule (the tokens of one flush, repeated until the limit) asked an engine
    at 3.3-33 ms/token for up to 120 tokens per event with a 64-token limit, its oldest token up to
    3x the flush old (bench/profile_notes.md, "Fourth pass"). 1 until the engine's speed is
    measured. An engine faster than measured sends events sooner, and the batcher holds them as it
    would single tokens: never more messages than without engine batching.
    """
    limit = max(1, limit)
    if interval_s <= 0:
        return limit
    if gap_s is None:
        return 1
    return max(1, min(limit, int(2 * interval_s / max(gap_s, 1e-6))))


class Rollout:
    """Generates samples on the engine pool."""

    def __init__(
        self,
        pool: EnginePool,
        admission: Admission,
        registry: InFlightRegistry,
        config: RolloutConfig | None = None,
        call_ids: CallIds | None = None,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.registry = registry
        self.config = config or RolloutConfig()
        #: Engine call ids of this replica (a fresh instance token unless given).
        self.call_ids = call_ids or CallIds.new()
        self._abort_all_depth = 0
        self._closed = False
        #: Abort{mine} windows: a caller's new generations end ABORTED while its abort runs.
        self.owner_aborts = OwnerAborts()

    def close(self) -> None:
        """Refuse new generations (shutdown); in-flight ones continue."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """True once `close()` ran (a running RolloutStep then starts no more groups)."""
        return self._closed

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight; False on timeout."""
        return await self.registry.wait_idle(timeout)

    # ----------------------------------------------------------------------------- abort-all window

    @property
    def aborting(self) -> bool:
        """True while an abort-all runs on this replica: new generations end ABORTED at once."""
        return self._abort_all_depth > 0

    def begin_abort_all(self) -> None:
        """Open the abort-all window (nested calls are counted)."""
        self._abort_all_depth += 1

    def end_abort_all(self) -> None:
        """Close the abort-all window."""
        self._abort_all_depth = max(0, self._abort_all_depth - 1)

    # ----------------------------------------------------------------------------- generate

    async def generate(
        self,
        sample: Sample,
        params: SamplingParams,
        options: GenerateOptions,
        request_id: str,
        on_first_token: Callable[[], None] | None = None,
    ) -> AsyncIterator[TokenBatch | Sample]:
        """Yield token batches, then the final sample (always last, exactly once).

        `on_first_token` is called once, when the first token of this Generate arrives from an
        engine, whatever the caller asked for: a `final_only` caller gets no batch to time, and its
        time to first token is still the engine's (the latency metrics are read from this).
        """
        if self._closed:
            raise Unavailable("the server is shutting down; retry on another replica")
        sample_ops.check_input(sample)
        params_mod.validate(params, skip_text=options.skip_text)
        routed_experts.check_input(sample.routed_experts, sample.token_count, options)
        if sample.status in sample_ops.FINISHED:
            yield sample
            return
        sample_ops.prepare_masks(sample, options.mask_offpolicy)
        budget = sample_ops.remaining_budget(sample, params)
        if budget == 0:
            sample_ops.finish(sample, Finish.LENGTH, Status.TRUNCATED)
            yield sample
            return
        if self.aborting or self.owner_aborts.aborting(current_caller().identity):
            sample_ops.finish(sample, Finish.ABORT, Status.ABORTED)
            yield sample
            return
        entry = self.registry.register(request_id, sample.session_id, sample.group_index)
        deadline = CallerDeadline(
            options.deadline, entry, self.config.deadline_margin_s, self.config.deadline_abort_lead_s
        )
        try:
            try:
                async with self.admission.slot(entry):
                    async for batch in self._run(sample, params, options, entry, deadline, on_first_token):
                        yield batch
            except AbortedWhileQueued:
                sample_ops.finish(sample, Finish.ABORT, Status.ABORTED, deadline.reason)
        finally:
            deadline.cancel()
            self.registry.unregister(entry)
        problem = sample_ops.check_invariants(sample)
        if problem:
            sample_ops.finish(sample, Finish.ERROR, Status.FAILED, problem)
        yield sample

    async def _run(
        self,
        sample: Sample,
        params: SamplingParams,
        options: GenerateOptions,
        entry: InFlight,
        deadline: CallerDeadline,
        on_first_token: Callable[[], None] | None = None,
    ) -> AsyncIterator[TokenBatch]:
        """The engine calls of one generation: call, and on failure do what `failover.decide` says."""
        batcher = _Batcher(options)
        run = _RunState(call_offset=sample.response_length, deadline=deadline, on_first_token=on_first_token)
        while not entry.abort_requested and not deadline.abort_due:
            engine = self._pick(sample, options, run)
            run.decision, run.error = None, None
            if engine is None:
                run.decision = _decide(
                    self._situation(CallFailure.NO_ENGINE, sample, params, entry, run, 0), entry
                )
            else:
                async for batch in self._attempt(engine, sample, params, options, entry, run, batcher):
                    yield batch
            decision = run.decision
            if decision is None:
                _blame_the_deadline(sample, entry, deadline)
                break  # the call ended normally
            if decision.action is Action.RAISE:
                unusable = self.pool.unusable_reasons() if engine is None else []
                raise _domain_error(decision, run.error, unusable) from run.error
            if decision.action is Action.FINISH:
                sample_ops.finish(sample, decision.finish, decision.status, decision.reason)
                break
            run.media_resent = run.media_resent or decision.action is Action.RETRY_WITH_MEDIA
        else:
            reason = "" if entry.abort_requested else deadline.reason
            sample_ops.finish(sample, Finish.ABORT, Status.ABORTED, reason)
        last = batcher.flush()
        if last is not None:
            yield last

    async def _attempt(
        self,
        engine: EngineHandle,
        sample: Sample,
        params: SamplingParams,
        options: GenerateOptions,
        entry: InFlight,
        run: _RunState,
        batcher: _Batcher,
    ) -> AsyncIterator[TokenBatch]:
        """One engine call; on failure, `run.decision` says what next (None: the call succeeded)."""
        if not sample.token_count:
            await self._render_prompt(engine, sample, options)
        run.attempts += 1
        run.tried.add(engine.url)
        attempt = EngineAttempt(engine.url, sample.response_length, sample.response_length)
        sample.engine_attempts.append(attempt)
        try:
            with self.pool.lease(engine):
                async for batch in self._call(engine, sample, params, options, entry, run, batcher):
                    yield batch
            self.pool.report_success(engine)
            return
        except (EngineError, _DrainExpired, _Interrupted) as exc:
            run.error = exc if isinstance(exc, EngineError) else None
            failure = await self._classify(engine, exc)
            attempt.error = f"{failure.value}: {exc}"
        finally:
            attempt.end = sample.response_length
        if failure is CallFailure.REQUEST_FAILED:
            run.request_failures += 1
        self._label_orphans(sample, engine, attempt)
        tokens = sample.response_length - attempt.start
        run.decision = decision = _decide(self._situation(failure, sample, params, entry, run, tokens), entry)
        if decision.mark_unhealthy:
            self.pool.report_failure(engine, attempt.error)
        if decision.exclude_engine:
            run.excluded.add(engine.url)

    def _situation(
        self,
        failure: CallFailure,
        sample: Sample,
        params: SamplingParams,
        entry: InFlight,
        run: _RunState,
        tokens_this_call: int,
    ) -> Situation:
        features = sample.features
        return Situation(
            failure=failure,
            tokens_this_call=tokens_this_call,
            tokens_this_generate=sample.response_length - run.call_offset,
            attempts=run.attempts,
            max_attempts=self.config.max_engine_attempts,
            request_failures=run.request_failures,
            max_request_failures=self.config.max_request_failures,
            budget_left=sample_ops.remaining_budget(sample, params),
            abort_requested=entry.abort_requested,
            media_resent=run.media_resent,
            media_resendable=features is not None and multimodal.has_all_kwargs(features),
        )

    async def _classify(self, engine: EngineHandle, exc: BaseException) -> CallFailure:
        """The policy's name for an engine call's failure; an internal error asks the engine's health."""
        if isinstance(exc, _DrainExpired):
            return CallFailure.ABORT_DRAIN_EXPIRED
        if isinstance(exc, _Interrupted):  # only the caller's deadline gets here (see `_call`)
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

    def _stream_interval(self, engine: EngineHandle, options: GenerateOptions) -> int:
        """Tokens per engine SSE event: as many as the caller's batching releases at once.

        vLLM sends the first token at once, then every `stream_interval` tokens, and the final
        chunk (with every remaining token) whatever the count, so batching loses nothing. The
        engine is asked for the tokens of one whole stream message (`tokens_per_message`), so
        each SSE event becomes one message and no event waits in the batcher for the next.
        """
        if not self.config.engine_stream_interval:
            return 1
        if options.final_only:
            return self.config.final_only_stream_interval
        return tokens_per_message(
            options.stream_batch_tokens, options.stream_batch_interval_s, engine.token_gap_s
        )

    def _engine_call(
        self,
        engine: EngineHandle,
        sample: Sample,
        params: SamplingParams,
        options: GenerateOptions,
        entry: InFlight,
        run: _RunState,
    ) -> EngineCall:
        """The next engine call of this sample: its tokens so far, the remaining budget."""
        if sample.features:
            multimodal.align(sample.features, sample.token_ids())
        attempt = run.attempts - 1
        return EngineCall(
            call_id=self.call_ids.call_id(entry.owner, entry.request_id, attempt),
            attempt=attempt,
            prompt_token_ids=sample.token_ids(),
            sampling=params,
            max_tokens=sample_ops.remaining_budget(sample, params),
            min_tokens=sample_ops.remaining_min_tokens(sample, params),
            stream_interval=self._stream_interval(engine, options),
            top_logprobs=params.top_logprobs or 0,
            return_routed_experts=options.return_routed_experts,
            routed_experts_start=options.routed_experts_start if options.return_routed_experts else 0,
            features=sample.features,
            resend_media=run.media_resent,
            model=options.model,
            want_text=not options.skip_text,
        )

    async def _call(
        self,
        engine: EngineHandle,
        sample: Sample,
        params: SamplingParams,
        options: GenerateOptions,
        entry: InFlight,
        run: _RunState,
        batcher: _Batcher,
    ) -> AsyncIterator[TokenBatch]:
        """One engine call: append tokens as they arrive, then apply the final result.

        Once an abort is requested the engine gets `abort_drain_s` to send its final chunk; then
        the call ends here whatever the engine does (`_DrainExpired`). A health probe that finds
        the engine dead while this call was silent ends it as hung (`EngineHung`: failed over from
        the tokens produced), and the caller's deadline ends it at once (`_Interrupted`).
        """
        call = self._engine_call(engine, sample, params, options, entry, run)
        batcher.engine_batches(call.stream_interval)
        entry.engine = engine
        entry.engine_started = False
        entry.engine_request_ids.append(engine.client.engine_request_id(call.call_id))
        if call.top_logprobs and len(sample.top_logprobs) < sample.response_length:
            # Positions generated without top logprobs get empty entries, so index = position.
            missing = sample.response_length - len(sample.top_logprobs)
            sample.top_logprobs.extend(([], []) for _ in range(missing))
        sample.usage.prompt_tokens += len(call.prompt_token_ids)
        start = sample.response_length
        speed = _Speed(sample.response_length)
        finals: list[EngineFinal] = []
        stopper = _Stopper()
        unwatch = engine.watch(stopper.engine_dead)
        run.deadline.attach(_DeadlineAbort(engine, entry, stopper))
        # The drain bound goes through the stopper, never a timeout around the loop: a timeout
        # cancels the task wherever it is, and between reads that is the caller's gRPC write
        # (the RPC then ends without a status, and its caller waits forever).
        entry.on_abort = lambda: stopper.request_later(self.config.abort_drain_s, _Why.ABORT_DRAIN)
        if entry.abort_requested:  # asked while the call was being prepared
            entry.on_abort()
        try:
            async for batch in self._consume(
                engine, call, sample, entry, run, batcher, speed, finals, stopper
            ):
                yield batch
        except _Interrupted as exc:
            if exc.why is _Why.ENGINE_DEAD:
                raise EngineHung(
                    engine.url, "a health probe found the engine dead while this stream was silent"
                ) from None
            if exc.why is _Why.ABORT_DRAIN:
                raise _DrainExpired from None
            raise
        finally:
            entry.on_abort = None
            stopper.close()
            unwatch()
            run.deadline.detach()
        if not finals:
            raise EngineUnavailable(engine.url, "the stream ended without a final result")
        speed.report(engine, sample.response_length)
        self._apply_final(engine, finals[-1], sample, options, start)

    async def _consume(
        self,
        engine: EngineHandle,
        call: EngineCall,
        sample: Sample,
        entry: InFlight,
        run: _RunState,
        batcher: _Batcher,
        speed: _Speed,
        finals: list[EngineFinal],
        stopper: _Stopper,
    ) -> AsyncIterator[TokenBatch]:
        """Apply the call's events to the sample; the final result goes to `finals`.

        Each read of the engine stream is bracketed by `stopper`, which may interrupt that read,
        and only that (never the caller's own awaits between reads); the stream is closed however
        the loop ends (closing it makes the engine abort the request).
        """
        stream = engine.client.generate(call)
        try:
            while True:
                stopper.begin_read()
                try:
                    event = await anext(stream)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    stopper.check_interrupted()
                    raise
                finally:
                    stopper.reading = False
                stopper.last_event = time.monotonic()
                if isinstance(event, EngineDelta):
                    self._on_engine_started(engine, entry, run)
                    speed.first(sample.response_length + len(event.token_ids), bool(event.token_ids))
                    if event.token_ids and run.on_first_token is not None:
                        run.first_token()
                    batch = self._apply_delta(sample, event, batcher)
                    if batch is not None:
                        yield batch
                elif isinstance(event, EngineUsage):
                    sample.usage.cached_tokens += event.cached_tokens
                else:
                    finals.append(event)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def _on_engine_started(self, engine: EngineHandle, entry: InFlight, run: _RunState) -> None:
        if not entry.engine_started:
            entry.engine_started = True
            if entry.abort_requested or run.deadline.abort_due:
                # The abort may have reached the engine before the request did: send it again.
                _spawn_detached(_quiet_abort(engine, entry.engine_request_ids[-1:]))

    @staticmethod
    def _apply_delta(sample: Sample, delta: EngineDelta, batcher: _Batcher) -> TokenBatch | None:
        if not delta.token_ids:
            if delta.text:
                sample.response += delta.text
                batcher.add_text(sample.response_length, delta.text)
            return None
        offset = sample.response_length
        sample_ops.append_tokens(sample, delta.token_ids, delta.logprobs, delta.text)
        sample.usage.completion_tokens += len(delta.token_ids)
        if delta.top_logprobs is not None:
            sample.top_logprobs.extend(delta.top_logprobs)
        return batcher.add(offset, delta.token_ids, delta.logprobs, delta.text)

    def _apply_final(
        self, engine: EngineHandle, final: EngineFinal, sample: Sample, options: GenerateOptions, start: int
    ) -> None:
        """Status, stop reason, weight versions and routed experts from the final result."""
        finish, status = FINISH_STATUS[final.finish]
        sample.stop_reason = final.stop_reason
        if final.weight_spans:
            engine.weight_version = final.weight_spans[-1].version
        sample_ops.add_weight_spans(sample, final.weight_spans, start)
        failure = ""
        if options.return_routed_experts and final.routed_experts is not None:
            try:
                sample.routed_experts = routed_experts.merge(
                    sample.routed_experts,
                    final.routed_experts,
                    options.routed_experts_start,
                    sample.token_count,
                )
            except routed_experts.RoutedExpertsError as exc:
                finish, status, failure = Finish.ERROR, Status.FAILED, f"engine {engine.url}: {exc}"
        sample_ops.finish(sample, finish, status, failure)

    def _label_orphans(self, sample: Sample, engine: EngineHandle, attempt: EngineAttempt) -> None:
        """Give tokens of a broken engine call a weight-version span (the engine's last known one)."""
        covered = sample.weight_versions[-1].end if sample.weight_versions else 0
        start = max(covered, attempt.start)
        if sample.response_length > start:
            version = engine.weight_version or UNKNOWN_VERSION
            sample_ops.add_weight_spans(
                sample, [WeightSpan(version, 0, sample.response_length - start)], start
            )

    async def _render_prompt(self, engine: EngineHandle, sample: Sample, options: GenerateOptions) -> None:
        """Turn a prompt text into ids with the engine's tokenizer (the service loads none)."""
        try:
            rendered = await engine.client.render_text(sample.prompt or "", options.model)
        except EngineRejected as exc:
            raise _rejection(exc, default_field="sample.prompt") from exc
        except EngineError as exc:
            raise Unavailable(f"could not render the prompt: {exc.message}") from exc
        if not rendered.token_ids:
            raise InvalidArgument("sample.prompt", "the engine rendered the prompt to no tokens")
        sample.prompt_ids = tuple(rendered.token_ids)

    def _pick(self, sample: Sample, options: GenerateOptions, run: _RunState) -> EngineHandle | None:
        """The engine for the next call: usable, not at fault, untried while others remain, and
        able to return routed experts when they are asked for.

        R3 from engines that cannot return it (dense model, MoE without the flag; known from the
        capability check) is refused with FAILED_PRECONDITION naming each engine and its reason
        before anything is generated. After tokens of this Generate, the failover policy decides as
        for no engine at all (the sample keeps its tokens).
        """
        avoid = set(run.excluded)
        if options.return_routed_experts:
            unable = self._unable_to_route(run.excluded)
            produced = sample.response_length > run.call_offset
            if unable and not produced and len(unable) == self._usable_count(run.excluded):
                raise FailedPrecondition(
                    "return_routed_experts: no usable engine can return routed experts: "
                    + "; ".join(unable.values())
                )
            avoid |= unable.keys()
        return self.pool.pick(sample.session_id, exclude=avoid | run.tried) or self.pool.pick(
            sample.session_id, exclude=avoid
        )

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


@dataclass(slots=True)
class _RunState:
    """The failover bookkeeping of one Generate."""

    call_offset: int
    #: The caller's deadline (its engine call registers there while it runs).
    deadline: CallerDeadline
    attempts: int = 0
    request_failures: int = 0
    media_resent: bool = False
    #: Engines at fault (never tried again) and engines already tried (avoided while others remain).
    excluded: set[str] = field(default_factory=set)
    tried: set[str] = field(default_factory=set)
    #: What the last failed call decided (None after a call that ended normally) and its error.
    decision: Decision | None = None
    error: EngineError | None = None
    #: Called once, when the engine's first token of this Generate arrives (then cleared).
    on_first_token: Callable[[], None] | None = None

    def first_token(self) -> None:
        """The first token arrived: tell the observer once."""
        notify, self.on_first_token = self.on_first_token, None
        if notify is not None:
            notify()


class _Speed:
    """Measures an engine call's decode speed from its first token to its end."""

    __slots__ = ("_at", "_tokens")

    def __init__(self, tokens: int) -> None:
        self._at = 0.0
        self._tokens = tokens

    def first(self, tokens: int, has_tokens: bool) -> None:
        if has_tokens and not self._at:
            self._at, self._tokens = time.monotonic(), tokens

    def report(self, engine: EngineHandle, tokens: int) -> None:
        if self._at:
            engine.observe_token_gap(time.monotonic() - self._at, tokens - self._tokens)


class _DrainExpired(Exception):
    """An abort was requested and the engine did not end its call within `abort_drain_s`."""


class _Why(enum.Enum):
    """Why an engine call is ended from outside (`_Stopper`)."""

    #: A health probe of the call's engine failed, and the call got nothing since it began.
    ENGINE_DEAD = "engine_dead"
    #: The caller's deadline, less the margin, has come.
    DEADLINE = "deadline"
    #: An abort was requested `abort_drain_s` ago and the engine has not ended the call.
    ABORT_DRAIN = "abort_drain"


class _Interrupted(Exception):
    """An engine call was ended by its `_Stopper`."""

    def __init__(self, why: _Why) -> None:
        super().__init__(why.value)
        self.why = why


class _Stopper:
    """Ends one engine call from a callback — its engine found dead, the caller's deadline, an
    abort's drain bound — by interrupting the call's wait for the engine, and only that wait.

    The interruption cancels the reading task (as the adapter's idle watch does) while a read is
    in progress, so the cancellation lands inside the engine stream, which then closes itself
    (the engine aborts the request). Asked between reads (the caller's own awaits, e.g. a gRPC
    write under flow control, must never be cancelled), the next read does not start.
    `check_interrupted` tells this cancellation apart from anyone else's.
    """

    __slots__ = ("_base", "_fired", "_task", "_timer", "last_event", "reading", "why")

    def __init__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("an engine call runs outside a task")
        self._task = task
        self._base = 0
        self._fired = False
        self._timer: asyncio.TimerHandle | None = None
        self.reading = False
        self.why: _Why | None = None
        #: When the call last got an event (or began): a probe started later proves nothing.
        self.last_event = time.monotonic()

    def request(self, why: _Why) -> None:
        """End the call (the first reason wins)."""
        if self.why is not None:
            return
        self.why = why
        if self.reading:
            self._fired = True
            self._task.cancel()

    def request_later(self, delay: float, why: _Why) -> None:
        """`request(why)` in `delay` seconds (a second ask keeps the first timer)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(delay, self.request, why)

    def close(self) -> None:
        """The call ended: a pending `request_later` never fires."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def engine_dead(self, probe_started: float) -> None:
        """`EngineHandle.watch` callback: a probe begun at `probe_started` got no answer. A call
        that received an event since then is talking to a live engine (a slow probe is not a
        dead engine) and goes on."""
        if self.last_event < probe_started:
            self.request(_Why.ENGINE_DEAD)

    def begin_read(self) -> None:
        """A read of the engine stream starts; raises `_Interrupted` if the call was ended."""
        if self.why is not None:
            raise _Interrupted(self.why)
        self._base = self._task.cancelling()
        self.reading = True

    def check_interrupted(self) -> None:
        """After a CancelledError in a read: raise `_Interrupted` when the cancellation was this
        stopper's alone (it is then absorbed); return (the caller re-raises) otherwise."""
        if not self._fired:
            return
        self._fired = False
        if self._task.uncancel() <= self._base and self.why is not None:
            raise _Interrupted(self.why)


class _DeadlineAbort:
    """What the caller's deadline does to one engine call (`deadline.DeadlineCall`): abort it on its
    engine (the engine then ends it with its final chunk, every token in it), and later stop
    reading whatever the engine does (`_Stopper`, ended as `CallFailure.DEADLINE`)."""

    __slots__ = ("_engine", "_entry", "_stopper")

    def __init__(self, engine: EngineHandle, entry: InFlight, stopper: _Stopper) -> None:
        self._engine = engine
        self._entry = entry
        self._stopper = stopper

    def abort_upstream(self) -> None:
        # The call's id; if the engine has not seen the request yet, its first chunk sends the
        # abort again (`_on_engine_started`).
        _spawn_detached(_quiet_abort(self._engine, self._entry.engine_request_ids[-1:]))

    def stop(self) -> None:
        self._stopper.request(_Why.DEADLINE)


def _blame_the_deadline(sample: Sample, entry: InFlight, deadline: CallerDeadline) -> None:
    """An engine call that ended ABORTED after the deadline's upstream abort (and no one else's)
    says why, as a sample ended at the stop point does."""
    ours = deadline.abort_due and not entry.abort_requested
    if ours and sample.status is Status.ABORTED and not sample.failure_reason:
        sample.failure_reason = deadline.reason


#: Neutral finish -> (finish reason, sample status).
FINISH_STATUS: dict[FinishKind, tuple[Finish, Status]] = {
    FinishKind.STOP: (Finish.STOP, Status.COMPLETED),
    FinishKind.LENGTH: (Finish.LENGTH, Status.TRUNCATED),
    FinishKind.ABORT: (Finish.ABORT, Status.ABORTED),
    FinishKind.ERROR: (Finish.ERROR, Status.FAILED),
    FinishKind.REPETITION: (Finish.REPETITION, Status.COMPLETED),
}


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


_background: set[asyncio.Task[None]] = set()


def _spawn_detached(coro: Coroutine[Any, Any, None]) -> None:
    """Run a fire-and-forget coroutine, keeping a reference so it is not garbage-collected."""
    task = asyncio.create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _quiet_abort(engine: EngineHandle, ids: list[str]) -> None:
    """Best-effort abort (a lost abort is retried by the caller's own logic)."""
    try:
        await engine.client.abort_requests(ids)
    except EngineError as exc:
        log.warning("abort_failed", engine=engine.url, error=exc.message)
