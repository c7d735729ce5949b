"""When a step starts its next prompt groups: the over-sampling rule and staleness admission.

Two over-sampling rules (docs/rollout-step.md "Over-sampling"):

* `SLIME_BATCHES` (the default) is slime's `generate_rollout_async` (THUDM/slime at
  624b824a898ab0ec1fcb4d373004c7f3852bf515, `slime/rollout/sglang_rollout.py`): it keeps a count of
  groups submitted minus groups the dynamic filter dropped, and submits another batch of
  `over_sampling_batch_size` groups only while that count is below the target. Accepted groups never
  lower the count, so once enough groups are on their way no more start: the step generates what
  slime's loop generates, not a refill per dropped group.
* `KEEP_IN_FLIGHT` refills to `max_groups_in_flight` after every dropped group (lower latency to the
  target when drops are frequent, at the cost of groups generated and then aborted at the target).

Staleness admission is AReaL's `max_head_offpolicyness` (inclusionAI/AReaL, `StalenessManager`): work
is refused before it starts, rather than dropped after it was generated (`max_staleness`). The rule
here is the one a network service can check without the trainer's batch size: no group starts while
the trainer's consumed weight version is more than `k` versions behind the replica's newest.

The policy is pure (counters in, a number out) so it can be checked without engines.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rollout_grpc.server.rollout.step.versions import FleetVersions, VersionOrder


class OverSampling(enum.Enum):
    """How groups beyond the target are started (the proto's `OverSamplingPolicy`)."""

    SLIME_BATCHES = "slime_batches"
    KEEP_IN_FLIGHT = "keep_in_flight"


@dataclass(frozen=True, slots=True)
class Admission:
    """AReaL-style admission: the trainer's consumed version and the bound `k`."""

    consumed_version: str
    max_head_offpolicyness: int

    def refusal(self, versions: VersionOrder | FleetVersions) -> str:
        """Why no group may start now ("" when one may)."""
        lag = versions.lag(self.consumed_version)
        if lag <= self.max_head_offpolicyness:
            return ""
        return (
            f"admission refused: the consumed weight version {self.consumed_version!r} is {lag} versions "
            f"behind the newest {versions.newest!r} (max_head_offpolicyness {self.max_head_offpolicyness})"
        )


@dataclass(slots=True)
class Counters:
    """What the step has done so far, as the policy needs it."""

    #: Groups started (each start counts, a regenerated group twice).
    submitted: int = 0
    #: Groups that ended without being accepted: filtered, failed, stale.
    dropped: int = 0
    #: Groups accepted.
    accepted: int = 0
    #: Groups generating or being scored now.
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class StartPolicy:
    """How many groups to start now, from the step's counters and its queue."""

    rule: OverSampling
    target: int
    #: SLIME_BATCHES: groups per batch.
    batch: int
    #: Most groups in flight (0: no bound beyond the rule's own).
    max_in_flight: int

    @classmethod
    def of(cls, rule: OverSampling, target: int, batch_size: int, max_groups_in_flight: int) -> StartPolicy:
        """The policy of a step (`batch_size` 0: the target, slime's default; KEEP_IN_FLIGHT with
        `max_groups_in_flight` 0 keeps `target` groups in flight)."""
        if rule is OverSampling.KEEP_IN_FLIGHT:
            return cls(rule, target, 0, max_groups_in_flight or target)
        return cls(rule, target, batch_size or target, max_groups_in_flight)

    def to_start(self, c: Counters, queued: int) -> int:
        """Groups to start now (at most `queued`)."""
        if c.accepted >= self.target or queued <= 0:
            return 0
        if self.rule is OverSampling.KEEP_IN_FLIGHT:
            return max(0, min(queued, self.max_in_flight - c.in_flight))
        count = 0
        # slime: `while submitted - filtered < target: submit(over_sampling_batch_size)`.
        while c.submitted + count - c.dropped < self.target and count < queued:
            count = min(queued, count + self.batch)
        if self.max_in_flight:
            count = min(count, max(0, self.max_in_flight - c.in_flight))
        return count
