"""One RolloutStep's events collected by kind, for the simulator and the real-vLLM step tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_grpc.client import pb
from tests.harness import Harness


@dataclass
class StepRun:
    """Every event of one step, by kind."""

    groups: list[pb.GroupResult] = field(default_factory=list)
    samples: list[pb.Sample] = field(default_factory=list)
    progress: list[pb.StepProgress] = field(default_factory=list)
    summary: pb.StepSummary | None = None

    def by_outcome(self, outcome: int) -> list[pb.GroupResult]:
        return [g for g in self.groups if g.outcome == outcome]

    def outcomes(self) -> dict[int, int]:
        return {g.group_index: g.outcome for g in self.groups}

    def group(self, index: int) -> pb.GroupResult:
        [found] = [g for g in self.groups if g.group_index == index]
        return found


async def run_step(h: Harness, groups: list[Any], timeout: float = 120, **kw: Any) -> StepRun:
    """Run one step through `h`'s client to its end; the summary must be the last event."""
    run = StepRun()
    async for event in h.client.rollout_step(groups, timeout=timeout, **kw):
        kind = event.WhichOneof("event")
        assert run.summary is None, "the summary must be the last event"
        if kind == "group":
            run.groups.append(event.group)
        elif kind == "sample":
            run.samples.append(event.sample)
        elif kind == "progress":
            run.progress.append(event.progress)
        else:
            run.summary = event.summary
    assert run.summary is not None
    return run
