"""Agent sessions recorded turn by turn, assembled into training-ready samples.

A session is what one agent conversation sent through the front door. Each turn records exactly
what the engine saw (`prompt_ids`) and produced (response ids, logprobs, weight-version spans,
finish reason, routed experts), plus the tool calls parsed from it. Assembly turns consecutive
turns into one `Sample` when each turn's prompt extends the previous turn's tokens: the tokens
between them (template glue, tool results, the next user message: everything the template and
the environment inserted) get loss mask 0 and logprob 0.0; the generated tokens keep mask 1, their
logprobs and their weight-version spans (positions relative to the response, as everywhere).

Re-tokenisation drift: chat templates re-render the whole history every turn, and the rendering of
an earlier assistant message need not be the tokens the model produced (a non-canonical
tokenisation, tool calls re-serialised, reasoning stripped). `DriftPolicy` decides:

* `KEEP_PREFIX` (default): the engine is sent the recorded tokens, plus the template's closing of
  the assistant message, plus the rendering of the new messages only. The engine sees the exact
  trajectory the trainer will train on, and the session stays one sample (token-in/token-out).
* `SPLIT`: the engine is sent the template's full rendering; a turn whose prompt does not extend
  the recorded tokens starts a new sample. The engine sees what a fresh client would send, and the
  session becomes several samples.

The module is pure (no I/O): the front door renders and generates, this module decides, and
rollout/sessions.py records the turns in the state store.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rollout_grpc.server.domain import routed_experts, sample_ops
from rollout_grpc.server.domain.identity import ANONYMOUS
from rollout_grpc.server.domain.model import (
    EngineAttempt,
    Finish,
    RoutedExperts,
    Sample,
    Status,
    Usage,
    WeightSpan,
)


class DriftPolicy(enum.StrEnum):
    """What a turn whose rendered prompt does not extend the recorded tokens does."""

    KEEP_PREFIX = "keep_prefix"
    SPLIT = "split"


@dataclass(slots=True)
class Turn:
    """One chat completion: the engine's input and output, exactly."""

    request_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    #: Spans over this turn's response positions [0, len(response_ids)).
    weight_versions: list[WeightSpan]
    finish: Finish
    status: Status
    text: str
    #: OpenAI `tool_calls` elements parsed from the text.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    #: Routing of this turn's engine call; rows start at `routed_experts.start`.
    routed_experts: RoutedExperts | None = None
    #: True when this turn starts a new training sample (first turn, or a split after drift).
    new_sample: bool = True
    #: True when the template's rendering did not extend the recorded tokens.
    drift: bool = False
    failure: str = ""
    usage: Usage = field(default_factory=Usage)
    #: Engine calls of this turn over its response positions (more than one after a failover).
    engine_attempts: list[EngineAttempt] = field(default_factory=list)


@dataclass(slots=True)
class Session:
    """One conversation's turns, as recorded in the state store (rollout/sessions.py)."""

    session_id: str
    #: Identity of the caller whose turn first recorded in the session: only it adds turns, only
    #: it (or an admin) reads the trajectory (`identity.py`; "anonymous" for every caller when
    #: auth is off).
    owner: str = ANONYMOUS.identity
    turns: list[Turn] = field(default_factory=list)
    #: Roles of the last request's messages plus "assistant" for its reply (continuation check).
    roles: list[str] = field(default_factory=list)

    def tokens(self) -> list[int]:
        """Every token of the current sample so far (the last turn's input and output)."""
        if not self.turns:
            return []
        last = self.turns[-1]
        return last.prompt_ids + last.response_ids

    def continues(self, roles: list[str]) -> int | None:
        """Index of the first new message when `roles` extends this session's conversation."""
        n = len(self.roles)
        if not self.turns or len(roles) <= n or roles[:n] != self.roles:
            return None
        return n


def extends(previous: list[int], rendered: list[int]) -> bool:
    """True when `rendered` starts with every token of `previous` (no drift)."""
    return len(rendered) >= len(previous) and rendered[: len(previous)] == previous


def splice(previous: list[int], closing: list[int], delta: list[int]) -> list[int]:
    """KEEP_PREFIX's next input: recorded tokens + the rest of the closing + the new messages.

    `closing` is what the template puts after an assistant message's content (ChatML:
    `<|im_end|>\\n`); the model usually produced its start itself (the stop token), so only the
    part it did not produce is inserted. A truncated turn gets the whole closing.
    """
    for k in range(min(len(closing), len(previous)), 0, -1):
        if previous[-k:] == closing[:k]:
            return previous + closing[k:] + delta
    return previous + closing + delta


def to_samples(session: Session) -> list[Sample]:
    """The session as training samples, one per run of extending turns (see the module docstring)."""
    return to_samples_indexed(session)[0]


def to_samples_indexed(session: Session) -> tuple[list[Sample], list[int]]:
    """The samples, and for each turn the index of the sample holding it."""
    samples: list[Sample] = []
    indexes: list[int] = []
    current: Sample | None = None
    for turn in session.turns:
        if current is None or turn.new_sample:
            current = Sample(session_id=session.session_id, prompt_ids=tuple(turn.prompt_ids))
            samples.append(current)
        else:
            inserted = turn.prompt_ids[current.token_count :]
            current.response_ids.extend(inserted)
            current.loss_mask.extend([0] * len(inserted))
            current.rollout_log_probs.extend([0.0] * len(inserted))
            current.response_length += len(inserted)
        indexes.append(len(samples) - 1)
        offset = current.response_length
        current.response_ids.extend(turn.response_ids)
        current.loss_mask.extend([1] * len(turn.response_ids))
        current.rollout_log_probs.extend(turn.logprobs)
        current.response_length += len(turn.response_ids)
        current.response += turn.text
        sample_ops.add_weight_spans(current, turn.weight_versions, offset)
        current.engine_attempts.extend(
            EngineAttempt(a.engine, a.start + offset, a.end + offset, a.error) for a in turn.engine_attempts
        )
        current.usage.prompt_tokens += turn.usage.prompt_tokens
        current.usage.completion_tokens += turn.usage.completion_tokens
        current.usage.cached_tokens += turn.usage.cached_tokens
        if turn.routed_experts is not None:
            try:
                current.routed_experts = routed_experts.merge(
                    None if turn.new_sample else current.routed_experts,
                    turn.routed_experts.array,
                    turn.routed_experts.start,
                    current.token_count,
                )
            except routed_experts.RoutedExpertsError as exc:
                current.routed_experts = None
                turn.failure = turn.failure or f"routed experts dropped: {exc}"
        sample_ops.finish(current, turn.finish, turn.status, turn.failure)
    return samples, indexes
