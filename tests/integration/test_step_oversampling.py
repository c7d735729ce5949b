"""Over-sampling policies and staleness admission of RolloutStep, end to end on the simulator.

The default policy must start exactly the groups slime's `generate_rollout_async` would: a batch of
`over_sampling_batch_size` only while (groups submitted - groups dropped) < target. The test replays
slime's loop, written here independently of `policy.py`, over the order in which the step's groups
actually ended, and compares the number of groups each started.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from rollout_grpc.client import make_sample, pb
from tests.harness import Harness, harness
from tests.support.reward_server import RewardServer
from tests.support.service import PROMPT, SLOW_SIM, field_violation
from tests.support.steps import StepRun, run_step

SHORT = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "seed": 38}
DROPPED = (pb.GROUP_OUTCOME_FILTERED, pb.GROUP_OUTCOME_FAILED, pb.GROUP_OUTCOME_STALE)


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with harness("sim", sim_count=2) as running:
        yield running


def seeded_groups(count: int, seed: int) -> list[pb.PromptGroup]:
    """`count` groups with distinct prompts; a seeded 40 % are "one" (always filtered: every sample
    scores 1.0), the rest "parity" (kept unless both samples happen to score the same)."""
    rng = random.Random(seed)
    return [
        pb.PromptGroup(
            prompt=make_sample([*PROMPT, 100 + g], index=2 * g),
            group_index=g,
            label="one" if rng.random() < 0.4 else "parity",
        )
        for g in range(count)
    ]


def slime_submitted(ended: list[tuple[int, bool]], supply: int, target: int, batch: int) -> int:
    """Groups slime's loop submits, given the order its groups end in ((index, dropped) pairs).

    slime (sglang_rollout.generate_rollout_async): `while len(data) < target: while
    remaining < target: submit(data_source(over_sampling_batch_size))`, then wait for one group;
    a dropped group does `remaining -= 1`.
    """
    submitted = remaining = accepted = 0
    order = iter(ended)
    while accepted < target:
        while remaining < target and submitted < supply:
            batch_now = min(batch, supply - submitted)
            submitted += batch_now
            remaining += batch_now
        index, dropped = next(order)
        assert index < submitted, f"group {index} ended before slime would have submitted it"
        if dropped:
            remaining -= 1
        else:
            accepted += 1
    return submitted


def started(run: StepRun, supply: int) -> int:
    assert run.summary is not None
    return supply - len(run.summary.unstarted_group_indexes)


@pytest.mark.parametrize(("seed", "target", "batch"), [(1, 8, 0), (2, 8, 0), (3, 6, 4), (4, 5, 7)])
async def test_the_default_policy_starts_exactly_the_groups_slime_would(
    h: Harness, seed: int, target: int, batch: int
) -> None:
    supply = 48
    async with RewardServer() as rm:
        run = await run_step(
            h,
            seeded_groups(supply, seed),
            n_samples_per_prompt=2,
            params=SHORT,
            target_groups=target,
            over_sampling_batch_size=batch,
            reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url},
            filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
        )
    assert run.summary is not None and run.summary.accepted == target
    ended = [
        (g.group_index, g.outcome in DROPPED) for g in run.groups if g.outcome != pb.GROUP_OUTCOME_ABORTED
    ]
    assert any(dropped for _, dropped in ended), "the seeded labels must make the filter drop groups"
    expected = slime_submitted(ended, supply, target, batch or target)
    assert started(run, supply) == expected
    # Groups are started in request order: the unstarted ones are the tail.
    assert list(run.summary.unstarted_group_indexes) == list(range(expected, supply))


async def test_keep_in_flight_refills_after_every_dropped_group(h: Harness) -> None:
    """The explicit alternative: each dropped group is replaced at once, so at most
    `max_groups_in_flight` groups more than accepted + dropped are ever started."""
    supply = 48
    async with RewardServer() as rm:
        run = await run_step(
            h,
            seeded_groups(supply, 1),
            n_samples_per_prompt=2,
            params=SHORT,
            target_groups=8,
            max_groups_in_flight=3,
            over_sampling="keep_in_flight",
            reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url},
            filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
        )
    assert run.summary is not None and run.summary.accepted == 8
    ended = [g for g in run.groups if g.outcome != pb.GROUP_OUTCOME_ABORTED]
    aborted = [g for g in run.groups if g.outcome == pb.GROUP_OUTCOME_ABORTED]
    assert started(run, supply) == len(ended) + len(aborted) <= len(ended) + 3 - 1


async def test_admission_refuses_to_start_work_for_a_trainer_too_far_behind(h: Harness) -> None:
    for version in ("5", "6", "7"):
        await h.client.pause()
        await h.client.resume(weight_version=version)
    groups = seeded_groups(4, 1)
    behind = await run_step(
        h,
        groups,
        n_samples_per_prompt=2,
        params=SHORT,
        consumed_weight_version="5",
        max_head_offpolicyness=1,
    )
    assert behind.summary is not None and behind.groups == []
    assert (
        "admission refused" in behind.summary.reason and "max_head_offpolicyness 1" in behind.summary.reason
    )
    assert list(behind.summary.unstarted_group_indexes) == [0, 1, 2, 3]
    within = await run_step(
        h, groups, n_samples_per_prompt=2, params=SHORT, consumed_weight_version="5", max_head_offpolicyness=2
    )
    assert within.summary is not None and within.summary.accepted == 4


@pytest.mark.parametrize(
    ("policies", "field"),
    [
        ({"over_sampling_batch_size": -1}, "over_sampling_batch_size"),
        ({"max_head_offpolicyness": 1}, "consumed_weight_version"),
        ({"max_head_offpolicyness": -1, "consumed_weight_version": "1"}, "max_head_offpolicyness"),
        ({"consumed_weight_version": "1"}, "consumed_weight_version"),
    ],
)
async def test_bad_over_sampling_and_admission_fields_are_named(
    h: Harness, policies: dict[str, Any], field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(h, seeded_groups(2, 1), n_samples_per_prompt=2, params=SHORT, **policies)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(err.value) == field


async def test_a_group_aborted_from_outside_is_replaced_by_the_default_policy() -> None:
    """Abort(group_index) ends one group and the step goes on: slime's rule counts it as a group
    that will not be accepted, so the next prompt group starts and the target is still reached."""
    async with harness("sim", sim_config=SLOW_SIM) as slow:
        run = StepRun()
        aborted = False
        async for event in slow.client.rollout_step(
            [(make_sample(PROMPT, index=2 * g), g) for g in range(4)],
            n_samples_per_prompt=2,
            params={**SHORT, "max_new_tokens": 300},
            target_groups=2,
            step_id="ext",
            timeout=120,
        ):
            kind = event.WhichOneof("event")
            if kind == "progress" and event.progress.in_flight == 2 and not aborted:
                aborted = True
                await slow.client.abort(group_index=0)
            elif kind == "group":
                run.groups.append(event.group)
            elif kind == "summary":
                run.summary = event.summary
    assert run.summary is not None and run.summary.target_reached, run.summary
    assert run.outcomes()[0] == pb.GROUP_OUTCOME_ABORTED
    assert sorted(g.group_index for g in run.by_outcome(pb.GROUP_OUTCOME_ACCEPTED)) == [1, 2]
