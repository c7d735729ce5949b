"""What a rollout step streams to its caller, in domain terms: each sample as it ends, each group's
outcome, the counters, and the summary at the end.

Kept apart from the step's machinery so the facade and the gRPC conversion name these values
without importing the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_grpc.server.rollout.step.spec import (
    Outcome,
    StepSample,
)


@dataclass(slots=True)
class SampleEnded:
    """A sample's generation ended (before its reward)."""

    group_index: int
    item: StepSample


@dataclass(slots=True)
class GroupEnded:
    """A group ended: accepted, dropped (with the reason), aborted or buffered."""

    group_index: int
    outcome: Outcome
    reason: str
    samples: list[StepSample]
    version_lag: list[int]


@dataclass(slots=True)
class Progress:
    """The step's counters."""

    generated: int = 0
    scored: int = 0
    accepted: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    pending: int = 0


@dataclass(slots=True)
class Summary:
    """The end of the step."""

    accepted: int
    target_reached: bool
    reason: str
    buffered: int
    unstarted: list[int]
    progress: Progress
    max_version_lag: int
    #: Groups of this caller's earlier, abandoned step that did not fit in its buffer.
    lost: list[int] = field(default_factory=list)


StepEvent = SampleEnded | GroupEnded | Progress | Summary
