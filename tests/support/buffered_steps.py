"""RolloutSteps that really buffer groups, and the checks of their continuation, for tests that run
the step against real `rollout-grpc serve` processes (workers, replicas, a shared store).

`buffering_step` runs group 0 nearly done next to `long_groups` groups of `budget` tokens, all in
flight at once (`over_sampling="keep_in_flight"`) with a target of one group: when group 0 is
accepted the others are still generating, and `leftovers=BUFFER` aborts them into the caller's
buffer with the tokens they have. `assert_continued` checks the continue step received exactly
those groups, each sample finished at exactly its original budget (the remaining `max_new_tokens`
was the budget minus what the first step generated) and with the first step's tokens marked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.support.partials import aborted_partials
from tests.support.steps import StepRun

#: A short prompt of ordinary ids (valid in the simulator's vocabulary).
PROMPT = [1, 92, 510, 206, 62, 79, 286, 317]
#: Samples per group.
N = 2
#: Group 0's tokens still to generate (it ends long before the others).
QUICK_LEFT = 2


def params(budget: int) -> dict[str, Any]:
    """Exactly `budget` tokens per sample unless aborted (EOS ignored)."""
    return {"temperature": 1.0, "max_new_tokens": budget, "ignore_eos": True}


async def step_on(
    client: AsyncRolloutClient, groups: Sequence[Any], timeout: float = 120, **kw: Any
) -> StepRun:
    """One step through `client` to its end; the summary must be the last event."""
    run = StepRun()
    async for event in client.rollout_step(groups, n_samples_per_prompt=N, timeout=timeout, **kw):
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


async def buffering_step(
    client: AsyncRolloutClient, *, step_id: str, buffer_name: str, budget: int, long_groups: int = 2
) -> list[int]:
    """Run a step that buffers `long_groups` groups; their indexes (checked to be buffered)."""
    quick = pb.PromptGroup(
        prompt=make_sample(PROMPT), group_index=0, partial=aborted_partials(PROMPT, 0, N, budget - QUICK_LEFT)
    )
    longs = [(make_sample(PROMPT, index=N * i), i) for i in range(1, long_groups + 1)]
    run = await step_on(
        client,
        [quick, *longs],
        params=params(budget),
        target_groups=1,
        max_groups_in_flight=1 + long_groups,
        over_sampling="keep_in_flight",  # every group starts at once
        leftovers="buffer",
        step_id=step_id,
        buffer_name=buffer_name,
    )
    assert [g.group_index for g in run.by_outcome(pb.GROUP_OUTCOME_ACCEPTED)] == [0], run.outcomes()
    buffered = sorted(g.group_index for g in run.by_outcome(pb.GROUP_OUTCOME_BUFFERED))
    assert buffered == list(range(1, long_groups + 1)), run.outcomes()
    assert run.summary is not None and run.summary.buffered == long_groups, run.summary
    return buffered


async def continue_step(
    client: AsyncRolloutClient,
    *,
    step_id: str,
    buffer_name: str,
    budget: int,
    fresh_index: int,
    timeout: float = 120,
) -> StepRun:
    """A `continue_buffered` step with one fresh group `fresh_index` (the buffered ones run first)."""
    return await step_on(
        client,
        [(make_sample(PROMPT, index=100), fresh_index)],
        params=params(budget),
        options={"mask_offpolicy": True},  # the first step's tokens get loss_mask 0: they show
        continue_buffered=True,
        step_id=step_id,
        buffer_name=buffer_name,
        timeout=timeout,
    )


def assert_continued(run: StepRun, buffered: Sequence[int], *, first_step: str, budget: int) -> None:
    """`run` continued exactly the groups `buffered` of step `first_step`, each sample to its
    exact budget, the first step's tokens kept and marked."""
    continued = [g for g in run.groups if g.group_index in set(buffered)]
    assert sorted(g.group_index for g in continued) == sorted(buffered), run.outcomes()
    for group in continued:
        assert group.outcome == pb.GROUP_OUTCOME_ACCEPTED, (group.group_index, group.reason)
        assert len(group.samples) == N
        for sample in group.samples:
            assert sample.start_step_id == first_step
            assert sample.response_length == budget, "the remaining budget was exact"
            assert len(sample.tokens) == len(PROMPT) + budget
            assert len(sample.rollout_log_probs) == len(sample.loss_mask) == budget
            before = list(sample.loss_mask).count(0)
            assert 0 < before < budget, f"{before} tokens came from step {first_step}"
            assert list(sample.loss_mask) == [0] * before + [1] * (budget - before)
    assert run.summary is not None and run.summary.buffered == 0


async def abandoned_step(
    client: AsyncRolloutClient,
    *,
    step_id: str,
    buffer_name: str,
    budget: int,
    long_groups: int = 2,
    leftovers: str = "return",
) -> list[int]:
    """Start a step of group 0 nearly done and `long_groups` long groups, and leave it (cancel the
    call) as soon as group 0 is accepted: the long groups are then mid-generation, and the server
    aborts them into the caller's buffer. Their indexes.

    With `leftovers="buffer"` the step holds its drain lease from its start, so a continue step
    sent the moment the caller left (anywhere) waits for the drain; a RETURN step takes its lease
    only when its replica sees the caller leave (docs/rollout-step.md, "A trainer that disconnects
    mid-step")."""
    quick = pb.PromptGroup(
        prompt=make_sample(PROMPT), group_index=0, partial=aborted_partials(PROMPT, 0, N, budget - QUICK_LEFT)
    )
    longs = [(make_sample(PROMPT, index=N * i), i) for i in range(1, long_groups + 1)]
    stream = client.rollout_step(
        [quick, *longs],
        n_samples_per_prompt=N,
        params=params(budget),
        max_groups_in_flight=1 + long_groups,
        leftovers=leftovers,
        step_id=step_id,
        buffer_name=buffer_name,
        timeout=120,
    )
    async for event in stream:
        if event.WhichOneof("event") == "group":
            assert event.group.group_index == 0 and event.group.outcome == pb.GROUP_OUTCOME_ACCEPTED
            break
    await stream.aclose()  # the trainer goes away
    return list(range(1, long_groups + 1))
