"""Per-caller buffers of partial groups (slime's partial rollout, server side).

A step that reaches its target with `leftovers=BUFFER`, or whose caller went away mid-step, puts
its aborted groups here under the caller's identity; the caller's next step with
`continue_buffered` takes them first. Buffers live in this replica's memory: a restart loses them
(the trainer's own buffer is the durable one; docs/rollout-step.md says so).
"""

from __future__ import annotations

from rollout_grpc.server.rollout.step.spec import PromptGroup


class StepBuffers:
    """Owner identity -> its buffered groups, oldest first."""

    def __init__(self, max_groups_per_owner: int = 10_000) -> None:
        self._groups: dict[str, list[PromptGroup]] = {}
        self.max_groups_per_owner = max_groups_per_owner

    def put(self, owner: str, groups: list[PromptGroup]) -> list[PromptGroup]:
        """Buffer `groups` for `owner`; returns those that did not fit under the cap (the caller
        hands them back instead: a group is never dropped silently)."""
        held = self._groups.setdefault(owner, [])
        room = max(0, self.max_groups_per_owner - len(held))
        held.extend(groups[:room])
        return groups[room:]

    def take(self, owner: str) -> list[PromptGroup]:
        """Every buffered group of `owner` (the buffer empties)."""
        return self._groups.pop(owner, [])

    def indexes(self, owner: str) -> set[int]:
        """The group indexes `owner` has buffered."""
        return {g.group_index for g in self._groups.get(owner, [])}

    def count(self, owner: str) -> int:
        """How many groups `owner` has buffered."""
        return len(self._groups.get(owner, []))
