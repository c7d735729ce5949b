"""The state of one Generate and of its current engine call, as one object each.

`GenerateRun` is everything the attempt loop (`attempts.py`) and the engine call
(`engine_call.py`) read and write for one sample: the request (sample, sampling, options), its
in-flight entry and deadline, the stream batcher, and the failover bookkeeping. `Attempt` is one
engine call of it, with the budget computed once when the call starts. Passing these two objects,
not the same seven or eight values, is what lets each step of a call be read on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_grpc.server.domain import sample_ops
from rollout_grpc.server.domain.failover import Decision
from rollout_grpc.server.domain.model import EngineAttempt, GenerateOptions, Sample, SamplingParams
from rollout_grpc.server.engines.api import EngineError
from rollout_grpc.server.engines.pool import EngineHandle
from rollout_grpc.server.rollout.batching import StreamBatcher
from rollout_grpc.server.rollout.deadline import CallerDeadline
from rollout_grpc.server.rollout.inflight import InFlight


@dataclass(slots=True)
class GenerateRun:
    """One Generate: what it asked for, where it is registered, and its failover bookkeeping."""

    sample: Sample
    params: SamplingParams
    options: GenerateOptions
    entry: InFlight
    #: The caller's deadline (its engine call registers there while it runs).
    deadline: CallerDeadline
    batcher: StreamBatcher
    #: The response length when this Generate began (tokens before it are the caller's).
    call_offset: int
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

    @property
    def tokens_this_generate(self) -> int:
        """Tokens produced by this Generate so far (every engine call)."""
        return self.sample.response_length - self.call_offset


@dataclass(slots=True)
class Attempt:
    """One engine call of a Generate."""

    run: GenerateRun
    engine: EngineHandle
    #: 0-based number of this call within the Generate (part of its engine call id).
    number: int
    #: Tokens this call may generate (None = no limit): `max_new_tokens` less the response so far,
    #: computed once when the call starts.
    budget: int | None
    #: The call as the sample records it (`Sample.engine_attempts`).
    record: EngineAttempt

    @classmethod
    def start(cls, run: GenerateRun, engine: EngineHandle) -> Attempt:
        """Begin the next engine call of `run` on `engine` (counted and recorded on the sample)."""
        sample = run.sample
        run.attempts += 1
        run.tried.add(engine.url)
        record = EngineAttempt(engine.url, sample.response_length, sample.response_length)
        sample.engine_attempts.append(record)
        budget = sample_ops.remaining_budget(sample, run.params)
        return cls(run, engine, run.attempts - 1, budget, record)

    @property
    def tokens(self) -> int:
        """Tokens this call produced so far."""
        return self.run.sample.response_length - self.record.start

    @property
    def budget_left(self) -> int | None:
        """What remains of the budget after the tokens this call produced."""
        if self.budget is None:
            return None
        return max(0, self.budget - self.tokens)
