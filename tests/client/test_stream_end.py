"""A finished Generate is OK on the server too: the clients read each stream to its trailing status.

grpc-python cancels a call whose iterator is garbage-collected before the status arrived (the
`__del__` of the sync `_Rendezvous` and of `grpc.aio.Call`: "Cancelled upon garbage collection!").
A client that returned at the final sample and dropped the stream therefore turned a share of its
successful calls into CANCELLED on the server (one sync call in ten to one in six on simulated
engines; none seen with the asyncio client, whose status usually lands with the last message),
which polluted the replica's error metrics and `generate_done` log lines.
"""

from __future__ import annotations

import asyncio
import time

from rollout_grpc.client import AsyncRolloutClient, RolloutClient, pb
from tests.client.common import LONG, PROMPT
from tests.client.replica import Replica

TINY = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
CALLS = 200
RECORD_WAIT_S = 30.0


def recorded(replica: Replica, before: dict[str, float], calls: int) -> dict[str, float]:
    """OK and CANCELLED Generate calls the replica recorded since `before`, once it has `calls` of them.

    A call the client dropped may be recorded a little after the client moved on, so this polls the
    counter (bounded) until every call has one of the two outcomes instead of reading it once. Other
    codes are left out: a call of an earlier test ending late (DEADLINE_EXCEEDED) is not ours.
    """
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        after = replica.handled("Generate")
        delta = {code: after.get(code, 0.0) - before.get(code, 0.0) for code in ("OK", "CANCELLED")}
        if sum(delta.values()) >= calls or time.monotonic() > deadline:
            return delta
        time.sleep(0.01)  # polling the replica's counter, not waiting for a guessed duration


def test_sync_generate_calls_end_ok_on_the_server(replica: Replica) -> None:
    before = replica.handled("Generate")
    with RolloutClient(replica.target, timeout=30) as client:
        for _ in range(CALLS):
            done = client.generate(PROMPT, TINY)
            assert done.status == pb.SAMPLE_STATUS_TRUNCATED
        batch = client.generate([PROMPT] * 20, TINY)  # the thread-pool path too
        assert len(batch) == 20
    assert recorded(replica, before, CALLS + 20) == {"OK": CALLS + 20, "CANCELLED": 0}


async def test_async_generate_calls_end_ok_on_the_server(replica: Replica) -> None:
    before = await asyncio.to_thread(replica.handled, "Generate")
    async with AsyncRolloutClient(replica.target, timeout=30) as client:
        for _ in range(CALLS // 2):
            await client.generate(PROMPT, TINY)
        batch = await client.generate([PROMPT] * (CALLS // 2), TINY)
        assert len(batch) == CALLS // 2
    assert await asyncio.to_thread(recorded, replica, before, CALLS) == {"OK": CALLS, "CANCELLED": 0}


def test_a_stream_read_to_its_end_is_ok_and_one_left_early_is_cancelled(replica: Replica) -> None:
    """generate_stream: read to the end it is OK; a consumer that stops early cancels the call."""
    before = replica.handled("Generate")
    with RolloutClient(replica.target, timeout=30) as client:
        messages = list(client.generate_stream(PROMPT, TINY))
        assert messages[-1].HasField("sample")
        stream = client.generate_stream(PROMPT, LONG)
        assert next(stream).HasField("delta")
        stream.close()  # the consumer stops reading: the client cancels the call
    assert recorded(replica, before, 2) == {"OK": 1, "CANCELLED": 1}
