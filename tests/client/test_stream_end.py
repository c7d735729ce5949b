"""A finished Generate is OK on the server too: the clients read each stream to its trailing status.

grpc-python cancels a call whose iterator is garbage-collected before the status arrived (the
`__del__` of the sync `_Rendezvous` and of `grpc.aio.Call`: "Cancelled upon garbage collection!").
A client that returned at the final sample and dropped the stream therefore turned a share of its
successful calls into CANCELLED on the server (about 7-18 % of sync calls on simulated engines),
which polluted the replica's error metrics and `generate_done` log lines.
"""

from __future__ import annotations

import asyncio
import time

from rollout_grpc.client import AsyncRolloutClient, RolloutClient, pb
from tests.client.common import PROMPT
from tests.client.replica import Replica

TINY = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
CALLS = 200
RECORD_WAIT_S = 30.0


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {code: after.get(code, 0.0) - before.get(code, 0.0) for code in {*before, *after}}


def recorded(replica: Replica, before: dict[str, float], calls: int) -> dict[str, float]:
    """The Generate calls the replica recorded since `before`, by code, once it recorded `calls`.

    A call the client dropped may be recorded a little after the client moved on, so this polls the
    counter (bounded) until every call has an outcome instead of reading it once.
    """
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        delta = _delta(before, replica.handled("Generate"))
        if sum(delta.values()) >= calls or time.monotonic() > deadline:
            return {code: n for code, n in delta.items() if n}
        time.sleep(0.01)  # polling the replica's counter, not waiting for a guessed duration


def test_sync_generate_calls_end_ok_on_the_server(replica: Replica) -> None:
    before = replica.handled("Generate")
    with RolloutClient(replica.target, timeout=30) as client:
        for i in range(CALLS):
            done = client.generate(PROMPT, TINY, request_id=f"stream-end-sync-{i}-{time.time_ns()}")
            assert done.status == pb.SAMPLE_STATUS_TRUNCATED
        batch = client.generate([PROMPT] * 20, TINY)  # the thread-pool path too
        assert len(batch) == 20
    assert recorded(replica, before, CALLS + 20) == {"OK": CALLS + 20}


async def test_async_generate_calls_end_ok_on_the_server(replica: Replica) -> None:
    before = await asyncio.to_thread(replica.handled, "Generate")
    async with AsyncRolloutClient(replica.target, timeout=30) as client:
        for _ in range(CALLS // 2):
            await client.generate(PROMPT, TINY)
        batch = await client.generate([PROMPT] * (CALLS // 2), TINY)
        assert len(batch) == CALLS // 2
    assert await asyncio.to_thread(recorded, replica, before, CALLS) == {"OK": CALLS}


def test_a_stream_read_to_its_end_is_ok_and_one_left_early_is_cancelled(replica: Replica) -> None:
    """generate_stream: read to the end it is OK; a consumer that stops early cancels the call."""
    long = {"temperature": 1.0, "max_new_tokens": 3000, "ignore_eos": True}
    before = replica.handled("Generate")
    with RolloutClient(replica.target, timeout=30) as client:
        messages = list(client.generate_stream(PROMPT, TINY))
        assert messages[-1].HasField("sample")
        stream = client.generate_stream(PROMPT, long)
        assert next(stream).HasField("delta")
        stream.close()  # what `break` does: the client cancels the call it no longer reads
    assert recorded(replica, before, 2) == {"OK": 1, "CANCELLED": 1}
