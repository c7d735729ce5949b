"""What fleet control needs of a shared store: ask every process that reaches it, gather answers.

A replica's generations are known only to the process serving them (its in-flight registry), so
an abort by request id, session, group or owner must reach every process of the fleet. With
`--state-store redis://...` every process (each replica, each worker of `serve --workers N`)
already reaches one Redis; the store's bus (`redis_bus.py`, Redis pub/sub) carries the abort to all
of them, without a `--peer` mesh. The embedded stores (one process, or the supervisor's socket
store of `--workers N`) have no bus: there the sibling workers' own channels carry it.

The bus carries JSON objects and knows nothing of aborts (this room sits below the use cases):
`rollout/fanout.py` turns an abort selector into a message and the answers into a result.

Semantics every bus keeps:

* `ask_all(message, timeout_s)` delivers `message` to every process subscribed to the bus, this
  one included, and returns the answers of the others (a process answering its own question
  counts it as delivered, so that the number of answers to wait for is exactly the number of
  processes the store says it delivered to; nothing is guessed);
* a process whose handler fails answers `{"error": ...}` (the asker need not wait it out);
* an answer missing at `timeout_s` is left out and logged (a hung process delays an abort by at
  most the timeout, as a hung `--peer` does);
* the store not answering fails the call with `StoreUnavailable` naming it: an abort that needs the
  other replicas is not reported as done when it could not reach them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

#: A process's handler of a bus message: the JSON answer to send back.
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class FleetBus(Protocol):
    """Every process of the fleet that reaches one store, asked at once."""

    #: How errors name the store ("redis://host:6379/0").
    name: str

    async def start(self, handler: Handler) -> None:
        """Subscribe; from now on every other process's question is answered by `handler`."""
        ...

    async def ask_all(self, message: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """Deliver `message` to every subscribed process; the others' answers within `timeout_s`."""
        ...

    async def close(self) -> None:
        """Unsubscribe and stop answering."""
        ...
