"""A live replica that could not reach the store for longer than the drain lease (issue 37): the
lease expires, and the store reports the groups it held lost to the caller's next step. The step
learns it on its next renewal, and from then on buffers nothing: its leftovers come back to the
caller ABORTED with every token (the reason says why) instead of being both in the buffer and in
the lost list (where a continue step would continue a group and report it lost at once), and its
summary leaves out of `lost_group_indexes` the groups it returned itself.

In process (a real gRPC replica on loopback, simulated engines over HTTP): the store's
`renew_drain` fails the way a store that went away fails (`StoreUnavailable`) while the test cuts
it, for longer than the lease's TTL (`--step-drain-lease-ttl-s`, short here); every wait is on an
observed event, bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from rollout_grpc.client import pb
from rollout_grpc.server.domain.identity import ANONYMOUS
from rollout_grpc.server.rollout.step.buffer import buffer_owner
from rollout_grpc.server.state.api import StoreUnavailable
from tests.harness import Harness, harness
from tests.support.buffered_steps import N, buffering_step, step_on
from tests.support.service import SLOW_SIM

BUDGET = 60
#: Short, so that the cut outlives it quickly; renewals go every third of it.
LEASE_TTL_S = 0.6
WAIT_S = 30.0


@pytest.fixture
async def slow() -> AsyncIterator[Harness]:
    async with harness("sim", sim_config=SLOW_SIM, step_drain_lease_ttl_s=LEASE_TTL_S) as running:
        yield running


async def _until(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not await check():
        assert loop.time() < deadline, f"{what}: not within {WAIT_S:g} s"
        await asyncio.sleep(0.02)


async def test_a_step_whose_lease_expired_returns_its_leftovers_instead_of_buffering_them(
    slow: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = slow.server.state
    owner = buffer_owner(ANONYMOUS, "t")
    assert owner is not None
    buffered = await buffering_step(slow.client, step_id="a", buffer_name="t", budget=BUDGET)
    assert buffered == [1, 2]

    renew = store.renew_drain
    cut = asyncio.Event()
    answers: list[bool] = []

    async def renew_unless_cut(owner: str, lease: str) -> bool:
        if cut.is_set():
            raise StoreUnavailable(store.name, "ConnectionError: the test cut it off")
        live = await renew(owner, lease)
        answers.append(live)
        return live

    monkeypatch.setattr(store, "renew_drain", renew_unless_cut)
    await slow.client.pause("keep")  # the continue step's first group waits in the engine
    step = asyncio.create_task(
        step_on(
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
    )

    async def taken() -> bool:
        return (await store.holding(owner)).count == 0

    await _until("the continue step's take", taken)
    cut.set()

    async def lease_gone() -> bool:  # the caller's next continue step, elsewhere, waits on this
        return await store.wait_drains(owner, 0.0)

    await _until("the cut-off lease's expiry", lease_gone)
    cut.clear()

    async def renewal_saw_it() -> bool:
        return False in answers

    await _until("a renewal that finds the lease gone", renewal_saw_it)
    await slow.client.resume()
    run = await asyncio.wait_for(step, WAIT_S)

    [first, second] = run.groups
    assert first.outcome == pb.GROUP_OUTCOME_ACCEPTED and first.group_index in buffered
    # The group taken and never started is not put back (it is in the lost list): it comes back here.
    assert second.outcome == pb.GROUP_OUTCOME_ABORTED, run.outcomes()
    assert "drain lease expired" in second.reason and "returned instead of buffered" in second.reason
    assert len(second.samples) == N
    for sample in second.samples:
        assert sample.start_step_id == "a" and 0 < sample.response_length < BUDGET
        assert len(sample.rollout_log_probs) == sample.response_length
    assert run.summary is not None and run.summary.accepted == 1
    # The store reported both groups the lease held lost, but this step returned them itself: its
    # summary does not list them, and nothing of this step is left in the buffer.
    assert list(run.summary.lost_group_indexes) == []
    assert (await store.holding(owner)).count == 0
    assert await store.take_lost(owner) == []
