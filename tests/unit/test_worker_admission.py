"""The replica-wide in-flight counter of `serve --workers N` (workers/admission.py): who is woken.

Two workers' `SharedSlots` on one run directory, in one process: the file and the wake-up sockets
are the real ones; a datagram is in the receiver's buffer once `sendto` returned, so every check is
a non-blocking read, not a wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_grpc.server.rollout.inflight import InFlight
from rollout_grpc.server.workers.admission import SharedAdmission, SharedSlots, create_slots, reclaim_slots
from rollout_grpc.server.workers.supervisor import RestartPolicy


@pytest.fixture
def slots(tmp_path: Path) -> Iterator[list[SharedSlots]]:
    create_slots(str(tmp_path), 1, 2)  # one slot for the whole replica
    pair = [SharedSlots(str(tmp_path), i, 2) for i in range(2)]
    yield pair
    for s in pair:
        s.close()


def _woken(s: SharedSlots) -> bool:
    try:
        return bool(s.wake_socket.recv(64))
    except BlockingIOError:
        return False


def test_a_slot_given_back_wakes_no_sibling_when_none_waits(slots: list[SharedSlots]) -> None:
    zero, one = slots
    assert zero.try_take()
    zero.give_back()
    zero.notify()
    assert not _woken(one)
    assert zero.counts() == (0, 1)


def test_a_sibling_that_found_no_slot_is_woken_until_its_queue_is_empty(slots: list[SharedSlots]) -> None:
    zero, one = slots
    assert zero.try_take()
    assert not one.try_take()  # the replica's one slot is worker 0's
    assert one.waiting(1) and zero.waiting(1) and not zero.waiting(0)
    zero.give_back()
    zero.notify()
    assert _woken(one)
    assert one.try_take()
    one.stop_waiting()
    one.give_back()
    one.notify()
    zero.notify()
    assert not _woken(zero) and not _woken(one)


def test_the_slots_of_a_dead_worker_are_reclaimed_and_its_siblings_woken(tmp_path: Path) -> None:
    """A worker killed with slots taken never gives them back: the supervisor does, before the
    replacement starts, so the replica's limit is whole again and a waiting sibling starts."""
    create_slots(str(tmp_path), 3, 2)
    zero, one = (SharedSlots(str(tmp_path), i, 2) for i in range(2))
    try:
        assert one.try_take() and one.try_take() and zero.try_take()
        assert not zero.try_take() and zero.waiting(0)  # the limit is full; worker 0 waits
        one.give_back()  # worker 1 gave one back, then died holding the other
        one.close()
        assert reclaim_slots(str(tmp_path), 1, 2) == 1
        assert zero.counts() == (1, 3)
        assert _woken(zero)
        assert zero.try_take() and zero.try_take() and not zero.try_take()
        assert reclaim_slots(str(tmp_path), 1, 2) == 0  # nothing twice
    finally:
        zero.close()


def test_a_resize_wakes_every_sibling(slots: list[SharedSlots]) -> None:
    zero, one = slots
    admission = SharedAdmission(zero, 1, 4)
    admission.resize(2)
    assert _woken(one)


async def test_a_queued_generation_on_worker_1_starts_when_worker_0_frees_the_slot(
    slots: list[SharedSlots],
) -> None:
    zero, one = slots
    first, second = SharedAdmission(zero, 1, 4), SharedAdmission(one, 1, 4)
    loop = asyncio.get_running_loop()
    second.listen(loop)
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with first.slot(InFlight(request_id="a")):
            holding.set()
            await release.wait()

    async def queued() -> None:
        async with second.slot(InFlight(request_id="b")):
            pass

    holder = asyncio.create_task(hold())
    await holding.wait()
    waiter = asyncio.create_task(queued())
    await asyncio.sleep(0)  # one turn of the loop: the new task runs up to its wait in the queue
    assert second.queued == 1 and one.waiting(1)
    release.set()
    await holder
    await asyncio.wait_for(waiter, 30)  # started by worker 0's wake-up, not a poll
    assert not one.waiting(1)  # its queue is empty again
    assert zero.counts() == (0, 1)
    loop.remove_reader(one.wake_socket.fileno())


def test_dead_workers_are_replaced_with_back_off_until_the_cap_per_window() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60.0, delay_s=0.5, delay_cap_s=1.5)
    assert [policy.next_delay(t) for t in (0.0, 1.0, 2.0)] == [0.5, 1.0, 1.5]  # doubled, capped
    assert policy.next_delay(3.0) is None  # a 4th death within the window: the replica stops
    assert policy.next_delay(61.5) == 1.0  # two deaths left the window: this is the 2nd in it
