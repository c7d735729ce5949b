"""Cancellation of one engine call from outside: an engine found dead, the caller's deadline, an
abort's drain bound.

A `Stopper` interrupts only the call's wait for the engine (a read of its stream), never the
caller's own awaits between reads (e.g. a gRPC write under flow control, which must never be
cancelled: the RPC would end without a status). This module knows no engine: the engine call
(`engine_call.py`) brackets its reads with `begin_read` / `check_interrupted` and turns an
`Interrupted` into the failure the failover policy knows.
"""

from __future__ import annotations

import asyncio
import enum
import time


class DrainExpired(Exception):
    """An abort was requested and the engine did not end its call within `abort_drain_s`."""


class Why(enum.Enum):
    """Why an engine call is ended from outside (`Stopper`)."""

    #: A health probe of the call's engine failed, and the call got nothing since it began.
    ENGINE_DEAD = "engine_dead"
    #: The caller's deadline, less the margin, has come.
    DEADLINE = "deadline"
    #: An abort was requested `abort_drain_s` ago and the engine has not ended the call.
    ABORT_DRAIN = "abort_drain"


class Interrupted(Exception):
    """An engine call was ended by its `Stopper`."""

    def __init__(self, why: Why) -> None:
        super().__init__(why.value)
        self.why = why


class Stopper:
    """Ends one engine call from a callback — its engine found dead, the caller's deadline, an
    abort's drain bound — by interrupting the call's wait for the engine, and only that wait.

    The interruption cancels the reading task (as the adapter's idle watch does) while a read is
    in progress, so the cancellation lands inside the engine stream, which then closes itself
    (the engine aborts the request). Asked between reads (the caller's own awaits, e.g. a gRPC
    write under flow control, must never be cancelled), the next read does not start.
    `check_interrupted` tells this cancellation apart from anyone else's.
    """

    __slots__ = ("_base", "_fired", "_task", "_timer", "last_event", "reading", "why")

    def __init__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("an engine call runs outside a task")
        self._task = task
        self._base = 0
        self._fired = False
        self._timer: asyncio.TimerHandle | None = None
        self.reading = False
        self.why: Why | None = None
        #: When the call last got an event (or began): a probe started later proves nothing.
        self.last_event = time.monotonic()

    def request(self, why: Why) -> None:
        """End the call (the first reason wins)."""
        if self.why is not None:
            return
        self.why = why
        if self.reading:
            self._fired = True
            self._task.cancel()

    def request_later(self, delay: float, why: Why) -> None:
        """`request(why)` in `delay` seconds (a second ask keeps the first timer)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(delay, self.request, why)

    def close(self) -> None:
        """The call ended: a pending `request_later` never fires."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def engine_dead(self, probe_started: float) -> None:
        """`EngineHandle.watch` callback: a probe begun at `probe_started` got no answer. A call
        that received an event since then is talking to a live engine (a slow probe is not a
        dead engine) and goes on."""
        if self.last_event < probe_started:
            self.request(Why.ENGINE_DEAD)

    def begin_read(self) -> None:
        """A read of the engine stream starts; raises `Interrupted` if the call was ended."""
        if self.why is not None:
            raise Interrupted(self.why)
        self._base = self._task.cancelling()
        self.reading = True

    def check_interrupted(self) -> None:
        """After a CancelledError in a read: raise `Interrupted` when the cancellation was this
        stopper's alone (it is then absorbed); return (the caller re-raises) otherwise."""
        if not self._fired:
            return
        self._fired = False
        if self._task.uncancel() <= self._base and self.why is not None:
            raise Interrupted(self.why)
