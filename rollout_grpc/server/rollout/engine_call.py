"""One engine call of a Generate: build the request, read the engine's stream into the sample,
apply the final result.

Once an abort is requested the engine gets `abort_drain_s` to send its final chunk; then the call
ends whatever the engine does (`DrainExpired`). A health probe that finds the engine dead while
the call was silent ends it as hung (`EngineHung`: failed over from the tokens produced), and the
caller's deadline aborts it upstream, then ends it (`Interrupted`, see `deadline.py`). The
interruptions go through a `cancellation.Stopper`, never a timeout around the loop: a timeout
cancels the task wherever it is, and between reads that is the caller's gRPC write.
What happens after a failed call is the attempt loop's business (`attempts.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import structlog

from rollout_grpc.server.domain import multimodal, routed_experts, sample_ops
from rollout_grpc.server.domain.model import Finish, Status, TokenBatch
from rollout_grpc.server.engines.api import (
    EngineCall,
    EngineDelta,
    EngineError,
    EngineEvent,
    EngineFinal,
    EngineHung,
    EngineUnavailable,
    EngineUsage,
    FinishKind,
)
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout.batching import tokens_per_message
from rollout_grpc.server.rollout.call_ids import CallIds
from rollout_grpc.server.rollout.cancellation import DrainExpired, Interrupted, Stopper, Why
from rollout_grpc.server.rollout.config import RolloutConfig
from rollout_grpc.server.rollout.inflight import InFlight
from rollout_grpc.server.rollout.run_state import Attempt

log = structlog.get_logger(__name__)

#: Neutral finish -> (finish reason, sample status).
FINISH_STATUS: dict[FinishKind, tuple[Finish, Status]] = {
    FinishKind.STOP: (Finish.STOP, Status.COMPLETED),
    FinishKind.LENGTH: (Finish.LENGTH, Status.TRUNCATED),
    FinishKind.ABORT: (Finish.ABORT, Status.ABORTED),
    FinishKind.ERROR: (Finish.ERROR, Status.FAILED),
    FinishKind.REPETITION: (Finish.REPETITION, Status.COMPLETED),
}


class EngineCaller:
    """Runs engine calls with this replica's knobs and call ids, on the engines of one pool (which
    it tells the weight version an engine's final result names: the pool owns its handles)."""

    def __init__(self, pool: EnginePool, config: RolloutConfig, call_ids: CallIds) -> None:
        self.pool = pool
        self.config = config
        self.call_ids = call_ids

    def stream_interval(self, attempt: Attempt) -> int:
        """Tokens per engine SSE event: as many as the caller's batching releases at once.

        vLLM sends the first token at once, then every `stream_interval` tokens, and the final
        chunk (with every remaining token) whatever the count, so batching loses nothing. The
        engine is asked for the tokens of one whole stream message (`tokens_per_message`), so
        each SSE event becomes one message and no event waits in the batcher for the next.
        """
        if not self.config.engine_stream_interval:
            return 1
        options = attempt.run.options
        if options.final_only:
            return self.config.final_only_stream_interval
        return tokens_per_message(
            options.stream_batch_tokens, options.stream_batch_interval_s, attempt.engine.token_gap_s
        )

    def request(self, attempt: Attempt) -> EngineCall:
        """The engine request of this call: the sample's tokens so far, the remaining budget."""
        run = attempt.run
        sample, params, options = run.sample, run.params, run.options
        if sample.features:
            multimodal.align(sample.features, sample.token_ids())
        return EngineCall(
            call_id=self.call_ids.call_id(run.entry.owner, run.entry.request_id, attempt.number),
            attempt=attempt.number,
            prompt_token_ids=sample.token_ids(),
            sampling=params,
            max_tokens=attempt.budget,
            min_tokens=sample_ops.remaining_min_tokens(sample, params),
            stream_interval=self.stream_interval(attempt),
            top_logprobs=params.top_logprobs or 0,
            return_routed_experts=options.return_routed_experts,
            routed_experts_start=options.routed_experts_start if options.return_routed_experts else 0,
            features=sample.features,
            resend_media=run.media_resent,
            model=options.model,
            want_text=not options.skip_text,
        )

    async def stream(self, attempt: Attempt) -> AsyncIterator[TokenBatch]:
        """One engine call: append tokens as they arrive, then apply the final result.

        The read loop is here, not in a generator of its own re-yielding each batch: every
        streamed message resumes each generator of the chain (bench/profile_notes.md, twelfth
        pass). Each read of the engine stream is bracketed by the stopper, which may interrupt
        that read, and only that (never the caller's own awaits between reads); the stream is
        closed however the loop ends (closing it makes the engine abort the request).
        """
        engine = attempt.engine
        reading = self._start(attempt)
        stopper = reading.stopper
        unwatch = engine.watch(stopper.engine_dead)
        try:
            self._arm(reading)
            events = engine.client.generate(reading.call)
            try:
                while True:
                    stopper.begin_read()
                    try:
                        event = await anext(events)
                    except StopAsyncIteration:
                        break
                    except asyncio.CancelledError:
                        stopper.check_interrupted()
                        raise
                    finally:
                        stopper.reading = False
                    batch = reading.on_event(event)
                    if batch is not None:
                        yield batch
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()
        except Interrupted as exc:
            raise _interruption(exc, engine.url) from None
        finally:
            attempt.run.entry.on_abort = None
            stopper.close()
            unwatch()
            attempt.run.deadline.detach()
        if not reading.finals:
            raise EngineUnavailable(engine.url, "the stream ended without a final result")
        reading.speed.report(engine, attempt.run.sample.response_length)
        final = reading.finals[-1]
        if final.weight_spans:
            self.pool.relabel(engine, final.weight_spans[-1].version)
        _apply_final(attempt, final)

    def _start(self, attempt: Attempt) -> _Reading:
        """The call's request, noted in the in-flight entry and the sample."""
        run, engine = attempt.run, attempt.engine
        sample, entry = run.sample, run.entry
        call = self.request(attempt)
        run.batcher.engine_batches(call.stream_interval)
        entry.engine = engine
        entry.engine_started = False
        entry.engine_request_ids.append(engine.client.engine_request_id(call.call_id))
        if call.top_logprobs and len(sample.top_logprobs) < sample.response_length:
            # Positions generated without top logprobs get empty entries, so index = position.
            missing = sample.response_length - len(sample.top_logprobs)
            sample.top_logprobs.extend(([], []) for _ in range(missing))
        sample.usage.prompt_tokens += len(call.prompt_token_ids)
        return _Reading(attempt, call)

    def _arm(self, reading: _Reading) -> None:
        """Let the caller's deadline and an abort end the call (`stream` disarms both)."""
        run, stopper = reading.attempt.run, reading.stopper
        entry = run.entry
        run.deadline.attach(DeadlineAbort(reading.attempt.engine, entry, stopper))
        entry.on_abort = lambda: stopper.request_later(self.config.abort_drain_s, Why.ABORT_DRAIN)
        if entry.abort_requested:  # asked while the call was being prepared
            entry.on_abort()


def _interruption(exc: Interrupted, url: str) -> Exception:
    """What an interrupted engine call raises: a dead engine is hung, an abort's drain expired."""
    if exc.why is Why.ENGINE_DEAD:
        return EngineHung(url, "a health probe found the engine dead while this stream was silent")
    if exc.why is Why.ABORT_DRAIN:
        return DrainExpired()
    return exc


class _Reading:
    """The read side of one engine call: its stream's events into the sample and the batcher."""

    __slots__ = ("attempt", "call", "finals", "speed", "stopper")

    def __init__(self, attempt: Attempt, call: EngineCall) -> None:
        self.attempt = attempt
        self.call = call
        self.speed = _Speed(attempt.run.sample.response_length)
        self.finals: list[EngineFinal] = []
        self.stopper = Stopper()

    def on_event(self, event: EngineEvent) -> TokenBatch | None:
        """Apply one event of the engine stream to the sample: the batch to send, if one is due;
        the final result goes to `finals`."""
        run = self.attempt.run
        self.stopper.last_event = time.monotonic()
        if isinstance(event, EngineDelta):
            self._on_engine_started()
            sample = run.sample
            self.speed.first(sample.response_length + len(event.token_ids), bool(event.token_ids))
            if event.token_ids and run.on_first_token is not None:
                run.first_token()
            return self._apply_delta(event)
        if isinstance(event, EngineUsage):
            run.sample.usage.cached_tokens += event.cached_tokens
        else:
            self.finals.append(event)
        return None

    def _on_engine_started(self) -> None:
        run, engine = self.attempt.run, self.attempt.engine
        entry = run.entry
        if not entry.engine_started:
            entry.engine_started = True
            if entry.abort_requested or run.deadline.abort_due:
                # The abort may have reached the engine before the request did: send it again.
                spawn_detached(quiet_abort(engine, entry.engine_request_ids[-1:]))

    def _apply_delta(self, delta: EngineDelta) -> TokenBatch | None:
        sample, batcher = self.attempt.run.sample, self.attempt.run.batcher
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


def _apply_final(attempt: Attempt, final: EngineFinal) -> None:
    """The sample's status, stop reason, weight versions and routed experts from the final result
    (the engine's own label is the pool's: `EngineCaller.stream` relabels it)."""
    engine, sample, options = attempt.engine, attempt.run.sample, attempt.run.options
    finish, status = FINISH_STATUS[final.finish]
    sample.stop_reason = final.stop_reason
    sample_ops.add_weight_spans(sample, final.weight_spans, attempt.record.start)
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


class DeadlineAbort:
    """What the caller's deadline does to one engine call (`deadline.DeadlineCall`): abort it on its
    engine (the engine then ends it with its final chunk, every token in it), and later stop
    reading whatever the engine does (`Stopper`, ended as `CallFailure.DEADLINE`)."""

    __slots__ = ("_engine", "_entry", "_stopper")

    def __init__(self, engine: EngineHandle, entry: InFlight, stopper: Stopper) -> None:
        self._engine = engine
        self._entry = entry
        self._stopper = stopper

    def abort_upstream(self) -> None:
        # The call's id; if the engine has not seen the request yet, its first chunk sends the
        # abort again (`_Reading._on_engine_started`).
        spawn_detached(quiet_abort(self._engine, self._entry.engine_request_ids[-1:]))

    def stop(self) -> None:
        self._stopper.request(Why.DEADLINE)


_background: set[asyncio.Task[None]] = set()


def spawn_detached(coro: Coroutine[Any, Any, None]) -> None:
    """Run a fire-and-forget coroutine, keeping a reference so it is not garbage-collected."""
    task = asyncio.create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def quiet_abort(engine: EngineHandle, ids: list[str]) -> None:
    """Best-effort abort (a lost abort is retried by the caller's own logic)."""
    try:
        await engine.client.abort_requests(ids)
    except EngineError as exc:
        log.warning("abort_failed", engine=engine.url, error=exc.message)
