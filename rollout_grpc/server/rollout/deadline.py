"""A caller's deadline: abort the engine call upstream first, then hand the sample over in time.

A Generate whose caller set a deadline D (`GenerateOptions.deadline`, `allowed` seconds after
the call began) has two points before D (`domain/bounds.py` computes both):

* the **abort point** A = S - `deadline_abort_lead_s(allowed)`: the engine call in progress is
  aborted on its engine (`EngineAdapter.abort_requests`, the abort the Abort RPC sends), so the
  engine ends it the way vLLM and SGLang end every aborted request: with a final chunk holding
  every token it generated — also the ones it was holding back for `stream_interval` batching
  (up to 64 tokens for a `final_only` caller) — with their logprobs, weight versions and routed
  experts. A generation still queued for admission leaves the queue then (nothing was generated),
  and no new engine call (a failover) starts after A.
* the **stop point** S = D - `deadline_margin_s(allowed)`: the generation stops waiting for its
  engine, whatever the engine does, and the sample (ABORTED, every token received) is sent. An
  engine that answered the abort has ended the call before S; one that did not (hung, stopped)
  loses only what it never sent.

Before the abort point, S was the only point and the engine stream was closed there: the engine
aborted the request on the disconnect, but what it had buffered never arrived (measured: a
`final_only` Generate at 20 ms/token with a 1 s deadline ended ABORTED with 1 token of the 44 the
engine had made).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from rollout_grpc.server.domain import bounds
from rollout_grpc.server.rollout.inflight import AbortedWhileQueued, InFlight


class DeadlineCall(Protocol):
    """The engine call in progress, as the caller's deadline acts on it."""

    def abort_upstream(self) -> None:
        """Ask the engine to abort the call (it then sends its final chunk with every token)."""
        ...

    def stop(self) -> None:
        """Stop waiting for the engine now (the sample goes back with what arrived)."""
        ...


class CallerDeadline:
    """The two timers of one generation's deadline (none without a deadline).

    `abort_due` and `reached` tell the generation loop, between engine calls, that the abort or
    the stop point has passed; the engine call in progress registers itself (`attach`) to be
    aborted and stopped from the timers.
    """

    __slots__ = ("_abort_handle", "_call", "_entry", "_stop_handle", "abort_due", "reached")

    reason = "the caller's deadline is about to expire"

    def __init__(
        self,
        deadline: float | None,
        entry: InFlight,
        margin_cap_s: float = bounds.DEADLINE_MARGIN_S,
        abort_lead_cap_s: float = bounds.DEADLINE_ABORT_LEAD_S,
    ) -> None:
        self._entry = entry
        self._call: DeadlineCall | None = None
        self._abort_handle: asyncio.TimerHandle | None = None
        self._stop_handle: asyncio.TimerHandle | None = None
        self.abort_due = False
        self.reached = False
        if deadline is None:
            return
        left = deadline - time.monotonic()
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + left - bounds.deadline_margin_s(left, margin_cap_s)
        abort_at = stop_at - bounds.deadline_abort_lead_s(left, abort_lead_cap_s)
        self._abort_handle = loop.call_at(abort_at, self._abort)
        self._stop_handle = loop.call_at(stop_at, self._stop)

    def _leave_queue(self) -> None:
        waiter = self._entry.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(AbortedWhileQueued())

    def _abort(self) -> None:
        self._abort_handle = None
        self.abort_due = True
        self._leave_queue()
        if self._call is not None:
            self._call.abort_upstream()

    def _stop(self) -> None:
        self._stop_handle = None
        self.abort_due = self.reached = True
        self._leave_queue()
        if self._call is not None:
            self._call.stop()

    def attach(self, call: DeadlineCall) -> None:
        """An engine call starts; a point already passed acts on it at once."""
        self._call = call
        if self.reached:
            call.stop()
        elif self.abort_due:
            call.abort_upstream()

    def detach(self) -> None:
        """The engine call ended."""
        self._call = None

    def cancel(self) -> None:
        """The generation ended: neither timer fires."""
        for handle in (self._abort_handle, self._stop_handle):
            if handle is not None:
                handle.cancel()
        self._abort_handle = self._stop_handle = None
