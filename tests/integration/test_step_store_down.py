"""A continue step whose store stops answering after it took the caller's buffer: the groups it
took and never started cannot go back, so they are handed to the caller (ABORTED, every token,
the reason naming the store) instead of vanishing, and the summary still ends the step.

In process (a real gRPC replica on loopback, simulated engines over HTTP): the store's `put` is
made to fail the way a store that went away fails (`StoreUnavailable`); tests/faults/
test_store_faults.py kills a real redis-server for the other paths.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest

from rollout_grpc.client import pb
from rollout_grpc.server.state.api import StoredGroup, StoreUnavailable
from tests.harness import Harness, harness
from tests.support.buffered_steps import N, buffering_step, step_on
from tests.support.service import SLOW_SIM

BUDGET = 60


@pytest.fixture
async def slow() -> AsyncIterator[Harness]:
    async with harness("sim", sim_config=SLOW_SIM) as running:
        yield running


async def test_groups_taken_from_the_buffer_come_back_to_the_caller_when_the_store_is_gone(
    slow: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = slow.server.state
    buffered = await buffering_step(slow.client, step_id="a", buffer_name="t", budget=BUDGET)
    assert buffered == [1, 2]

    async def gone(owner: str, groups: Sequence[StoredGroup]) -> list[int]:
        raise StoreUnavailable(store.name, "ConnectionError: the test took it away")

    monkeypatch.setattr(store, "put", gone)
    # One group at a time and a target of one: the first buffered group runs, the second is taken
    # from the buffer but never started, and the store refuses it back.
    run = await step_on(
        slow.client,
        [],
        params={"temperature": 1.0, "max_new_tokens": BUDGET, "ignore_eos": True},
        continue_buffered=True,
        target_groups=1,
        max_groups_in_flight=1,
        options={"mask_offpolicy": True},
        step_id="b",
        buffer_name="t",
    )
    [first, second] = run.groups
    assert first.outcome == pb.GROUP_OUTCOME_ACCEPTED and first.group_index in buffered
    assert {(s.start_step_id, s.response_length) for s in first.samples} == {("a", BUDGET)}
    assert second.outcome == pb.GROUP_OUTCOME_ABORTED, run.outcomes()
    assert (
        f"the state store {store.name} is unavailable" in second.reason
        and "returned instead" in second.reason
    )
    assert len(second.samples) == N
    for sample in second.samples:
        assert sample.start_step_id == "a" and 0 < sample.response_length < BUDGET
        assert len(sample.rollout_log_probs) == sample.response_length
    assert run.summary is not None and run.summary.target_reached and run.summary.accepted == 1
