"""Which RolloutSteps touch the caller's buffer in the state store (issue 37, RETURN steps).

A step with `leftovers=RETURN` that does not continue buffered groups keeps nothing in the store:
it takes no drain lease and reads no buffer, so it pays no store round trip (with Redis, one per
call) on its path. Only when its caller leaves mid-step does it take a lease, then, and drain its
groups in flight into the caller's buffer, where the next continue step finds them.

In process (a real gRPC replica on loopback, simulated engines over HTTP); the store's buffer
calls are counted by wrapping the replica's own store. The fleet's weight-version read
(`version_order`, one per step for staleness) is not a buffer call and is not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from rollout_grpc.client import make_sample, pb
from tests.harness import Harness, harness
from tests.support.buffered_steps import (
    PROMPT,
    QUICK_LEFT,
    N,
    abandoned_step,
    assert_continued,
    continue_step,
    params,
    step_on,
)
from tests.support.partials import aborted_partials
from tests.support.service import SLOW_SIM

BUDGET = 60
#: Every call of `BufferStore` that reads or writes a caller's buffer, lease or lost list.
BUFFER_CALLS = (
    "put",
    "take",
    "take_held",
    "holding",
    "total_bytes",
    "note_lost",
    "take_lost",
    "begin_drain",
    "renew_drain",
    "end_drain",
    "hold_groups",
    "wait_drains",
)


@pytest.fixture
async def slow() -> AsyncIterator[Harness]:
    async with harness("sim", sim_config=SLOW_SIM) as running:
        yield running


def count_calls(store: object, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the buffer calls made on `store` from now on."""
    calls: Counter[str] = Counter()

    def counted(name: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return await call(*args, **kwargs)

        return wrapper

    for name in BUFFER_CALLS:
        if hasattr(store, name):  # (hold_groups is newer than the rest)
            monkeypatch.setattr(store, name, counted(name, getattr(store, name)))
    return calls


def _groups() -> list[Any]:
    """Group 0 nearly done, groups 1 and 2 far from it: with a target of one, two are left over."""
    quick = pb.PromptGroup(
        prompt=make_sample(PROMPT), group_index=0, partial=aborted_partials(PROMPT, 0, N, BUDGET - QUICK_LEFT)
    )
    return [quick, (make_sample(PROMPT, index=N), 1), (make_sample(PROMPT, index=2 * N), 2)]


async def _leftover_step(h: Harness, leftovers: str, step_id: str) -> list[tuple[int, int]]:
    run = await step_on(
        h.client,
        _groups(),
        params=params(BUDGET),
        target_groups=1,
        max_groups_in_flight=3,
        over_sampling="keep_in_flight",
        leftovers=leftovers,
        buffer_name="t",
        step_id=step_id,
    )
    return sorted((g.group_index, g.outcome) for g in run.groups)


async def test_a_step_returning_its_leftovers_makes_no_buffer_call(
    slow: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_calls(slow.server.state, monkeypatch)
    returned = await _leftover_step(slow, "return", "r")
    assert returned == [
        (0, pb.GROUP_OUTCOME_ACCEPTED),
        (1, pb.GROUP_OUTCOME_ABORTED),
        (2, pb.GROUP_OUTCOME_ABORTED),
    ]
    assert sum(calls.values()) == 0, dict(calls)
    # The same step buffering its leftovers does use the store (the count sees calls).
    buffered = await _leftover_step(slow, "buffer", "b")
    assert [o for _, o in buffered] == [pb.GROUP_OUTCOME_ACCEPTED] + [pb.GROUP_OUTCOME_BUFFERED] * 2
    assert calls["begin_drain"] == calls["end_drain"] == 1 and calls["put"] == 2, dict(calls)
    assert calls["hold_groups"] >= 2, dict(calls)  # its groups in flight, named as they change


async def test_a_returning_step_whose_caller_leaves_drains_into_its_buffer_under_a_lease(
    slow: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_calls(slow.server.state, monkeypatch)
    left = await abandoned_step(slow.client, step_id="left", buffer_name="t", budget=BUDGET)
    core = slow.sims[0].core
    await core.wait_until(lambda: not core.running)  # the replica aborted the left step's samples
    steps = slow.server.steps
    assert steps is not None
    await steps.drained()  # its drain (spawned with those aborts) has put the groups
    # The lease was taken when the caller left (not at the start), named the groups being
    # drained, and was given back once they were in the buffer.
    assert calls["begin_drain"] == calls["end_drain"] == 1, dict(calls)
    assert calls["hold_groups"] == 1 and calls["holding"] == 0, dict(calls)
    run = await continue_step(slow.client, step_id="next", buffer_name="t", budget=BUDGET, fresh_index=9)
    assert_continued(run, left, first_step="left", budget=BUDGET)
