"""Per-caller buffers of partial groups (slime's partial rollout, server side).

A step that reaches its target with `leftovers=BUFFER`, or whose caller went away mid-step, puts
its aborted groups here under the caller's identity; the caller's next step with
`continue_buffered` takes them first. Buffers live in this replica's memory: a restart loses them
(the trainer's own buffer is the durable one; docs/rollout-step.md says so).

The buffer is bounded in bytes, per caller and for the whole replica process, not only in groups:
a buffered group of 64 long samples is ~0.7-0.9 MB, so the old 10,000-group cap let one caller
hold 6.5-8.2 GB. A group's size is estimated from what it holds (`group_bytes`: token lists,
logprobs, masks, text, routed experts, media), an over-estimate of the Python objects. A group that
does not fit is handed back to the caller (`put` returns it); it is never dropped.
"""

from __future__ import annotations

import sys

from rollout_grpc.server.domain.model import Sample
from rollout_grpc.server.rollout.step.spec import PromptGroup, StepSample

#: Bytes per element of a list of ints: an 8-byte slot and a 28-byte int object (small ids are
#: shared objects in CPython; counting them anyway keeps the estimate an upper bound).
_INT_BYTES = 36
#: Bytes per element of a list of floats: an 8-byte slot and a 24-byte float object.
_FLOAT_BYTES = 32
#: The fixed part of a sample and its step record (dataclasses, empty lists, the wire message's
#: header kept as `origin`).
_SAMPLE_OVERHEAD = 1024
#: Lost group indexes remembered per owner until its next step reports them.
MAX_LOST = 100_000


def sample_bytes(sample: Sample) -> int:
    """An upper estimate of the memory `sample` holds (token ids are also counted once more for
    the transport message a partial sample keeps as its origin)."""
    size = _SAMPLE_OVERHEAD + (_INT_BYTES + 8) * sample.token_count
    size += _FLOAT_BYTES * len(sample.rollout_log_probs) + 8 * len(sample.loss_mask)
    size += sys.getsizeof(sample.response) + sys.getsizeof(sample.prompt or "")
    for ids, logprobs in sample.top_logprobs:
        size += 120 + _INT_BYTES * len(ids) + _FLOAT_BYTES * len(logprobs)
    if sample.routed_experts is not None:
        size += int(sample.routed_experts.array.nbytes)
    if sample.features is not None:
        for items in sample.features.modalities.values():
            for item in items:
                size += 200 + len(item.kwargs_data or b"") + len(item.mm_metadata or b"")
    return size


def group_bytes(group: PromptGroup) -> int:
    """An upper estimate of the memory a buffered group holds (its prompt and its samples)."""
    items: list[StepSample] = group.partial
    return sample_bytes(group.prompt) + sum(sample_bytes(i.sample) for i in items)


class StepBuffers:
    """Owner identity -> its buffered groups, oldest first, bounded in groups and in bytes."""

    def __init__(
        self,
        max_groups_per_owner: int = 10_000,
        max_bytes_per_owner: int = 256 << 20,
        max_bytes_total: int = 512 << 20,
    ) -> None:
        self._groups: dict[str, list[tuple[PromptGroup, int]]] = {}
        self._bytes: dict[str, int] = {}
        #: Per owner, indexes of groups of an abandoned step that did not fit (reported once).
        self._lost: dict[str, list[int]] = {}
        self.total_bytes = 0
        self.max_groups_per_owner = max_groups_per_owner
        self.max_bytes_per_owner = max_bytes_per_owner
        self.max_bytes_total = max_bytes_total

    def put(self, owner: str, groups: list[PromptGroup]) -> list[PromptGroup]:
        """Buffer `groups` for `owner`, in order, while they fit under the caps; returns those
        that did not fit (the caller hands them back instead: a group is never dropped)."""
        held = self._groups.setdefault(owner, [])
        rejected: list[PromptGroup] = []
        for group in groups:
            size = group_bytes(group)
            fits = (
                not rejected
                and len(held) < self.max_groups_per_owner
                and self._bytes.get(owner, 0) + size <= self.max_bytes_per_owner
                and self.total_bytes + size <= self.max_bytes_total
            )
            if not fits:
                rejected.append(group)
                continue
            held.append((group, size))
            self._bytes[owner] = self._bytes.get(owner, 0) + size
            self.total_bytes += size
        if not held:
            self._groups.pop(owner, None)
        return rejected

    def full_reason(self, owner: str) -> str:
        """Which cap a rejected group hit, for the reason handed back with it."""
        return (
            f"the step buffer is full (this caller holds {len(self._groups.get(owner, []))} groups, "
            f"{self._bytes.get(owner, 0)} bytes; caps {self.max_groups_per_owner} groups and "
            f"{self.max_bytes_per_owner} bytes per caller, {self.max_bytes_total} bytes in all: "
            "--step-buffer-mb-per-caller, --step-buffer-mb)"
        )

    def note_lost(self, owner: str, indexes: list[int]) -> None:
        """Remember groups of `owner`'s abandoned step that did not fit: its next step reports
        them (`take_lost`). At most `MAX_LOST` indexes are kept per owner (the oldest)."""
        lost = self._lost.setdefault(owner, [])
        lost.extend(indexes[: max(0, MAX_LOST - len(lost))])

    def take_lost(self, owner: str) -> list[int]:
        """The indexes `note_lost` kept for `owner` (forgotten once taken)."""
        return self._lost.pop(owner, [])

    def take(self, owner: str) -> list[PromptGroup]:
        """Every buffered group of `owner` (the buffer empties)."""
        held = self._groups.pop(owner, [])
        self.total_bytes -= self._bytes.pop(owner, 0)
        return [group for group, _ in held]

    def indexes(self, owner: str) -> set[int]:
        """The group indexes `owner` has buffered."""
        return {g.group_index for g, _ in self._groups.get(owner, [])}

    def count(self, owner: str) -> int:
        """How many groups `owner` has buffered."""
        return len(self._groups.get(owner, []))

    def bytes_of(self, owner: str) -> int:
        """The estimated bytes `owner`'s buffered groups hold."""
        return self._bytes.get(owner, 0)
