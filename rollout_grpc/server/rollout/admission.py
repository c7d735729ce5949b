"""Admission control: a global limit on generations in flight, with a bounded FIFO wait queue.

Sized as in slime: `server_concurrency x number of engines` generations may run at once; beyond
that, callers wait in a queue of bounded length, and when the queue is full they are refused with
RESOURCE_EXHAUSTED and a retry hint instead of piling up unbounded work. A queued generation that
is aborted leaves the queue at once (its waiter future fails with `AbortedWhileQueued`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from rollout_grpc.server.domain.errors import ResourceExhausted
from rollout_grpc.server.rollout.inflight import InFlight


class Admission:
    """Counts running generations against `limit`; queues at most `max_queue` more."""

    def __init__(self, limit: int, max_queue: int, retry_after_s: float = 1.0) -> None:
        if limit < 1:
            raise ValueError(f"the in-flight limit must be at least 1, got {limit}")
        self._limit = limit
        self._max_queue = max(0, max_queue)
        self._retry_after_s = retry_after_s
        self._running = 0
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def limit(self) -> int:
        """Generations that may run at once."""
        return self._limit

    @property
    def running(self) -> int:
        """Generations holding a slot."""
        return self._running

    @property
    def queued(self) -> int:
        """Generations waiting for a slot."""
        return sum(1 for f in self._queue if not f.done())

    def resize(self, limit: int) -> None:
        """Change the limit (e.g. after the engine list changed); wakes waiters if it grew."""
        self._limit = max(1, limit)
        self._wake()

    def _take(self) -> bool:
        """Take one slot if the limit allows. A limit shared with other processes overrides this
        and `_give_back` (workers/admission.py: `serve --workers N`)."""
        if self._running < self._limit:
            self._running += 1
            return True
        return False

    def _give_back(self) -> None:
        """Return one slot taken by `_take`."""
        self._running -= 1

    def _wake(self) -> None:
        while self._queue:
            fut = self._queue[0]
            if fut.done():  # aborted or cancelled while queued
                self._queue.popleft()
                continue
            if not self._take():
                return
            self._queue.popleft()
            fut.set_result(None)

    @contextlib.asynccontextmanager
    async def slot(self, entry: InFlight) -> AsyncIterator[None]:
        """Hold one slot for the body; raise ResourceExhausted when the queue is full."""
        if self._queue or not self._take():
            if self.queued >= self._max_queue:
                raise ResourceExhausted(
                    f"{self._running} generations in flight and {self.queued} queued (limits "
                    f"{self._limit} and {self._max_queue}); retry later",
                    self._retry_after_s,
                )
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._queue.append(fut)
            entry.waiter = fut
            try:
                await fut
            except BaseException:
                # Cancelled or aborted while queued. If the slot was granted in the same instant,
                # give it back so that the count stays right.
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._release()
                raise
            finally:
                entry.waiter = None
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self._give_back()
        self._wake()
