"""What a weight operation shares with the rest of the fleet through the state store: the
fleet lease that serialises updates and memory release/resume across replicas and workers, and
the fleet's weight-version order (never backwards).

Kept apart from the update's engine steps because it is the only part that talks to the store:
a replica killed mid-update blocks the others for at most the lease's TTL, and a store that does
not answer is handled here (refused before, logged after the engines took the weights).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import structlog

from rollout_grpc.server.domain.errors import FailedPrecondition
from rollout_grpc.server.rollout.weights.values import VERSION_FIELD, WEIGHTS_LEASE
from rollout_grpc.server.state.api import BufferStore, decimal_backwards

log = structlog.get_logger("rollout_grpc.server.rollout.weights")

T = TypeVar("T")


class FleetLease:
    """The fleet lease `weights` and the fleet's version order, in the shared store."""

    def __init__(self, store: BufferStore, holder: str, lease_ttl_s: float) -> None:
        #: The fleet's state (lease, version order).
        self._store = store
        #: How the lease names this process to the others ("replica … pid …", "worker 1 …").
        self._holder = holder
        self._lease_ttl_s = lease_ttl_s
        #: Operations that took the lease here (each token is its own).
        self._operations = 0

    async def take_lease(self, what: str) -> str:
        """Take the fleet lease for one operation (its token names this replica or worker and the
        operation), or FAILED_PRECONDITION naming the holder (UNAVAILABLE naming the store when it
        does not answer). Each operation's token is its own, so two operations of one process
        exclude each other too."""
        self._operations += 1
        token = f"{self._holder} ({what}, #{self._operations})"
        holder = await self._store.take_lease(WEIGHTS_LEASE, token, self._lease_ttl_s)
        if holder:
            raise FailedPrecondition(
                f"cannot {what}: a weight update or memory release holds the fleet lease on {holder}; "
                "updates are serialised fleet-wide: retry when it has finished (a holder that died "
                f"lets go within {self._lease_ttl_s:g} s)"
            )
        return token

    async def leased(self, token: str, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` holding the fleet lease `token` (already taken by `take_lease`)."""
        async with self.holding(token):
            return await work

    @contextlib.asynccontextmanager
    async def holding(self, token: str) -> AsyncIterator[None]:
        """The lease taken: renewed every third of its TTL meanwhile, released at the end whatever
        the outcome (a release that fails is logged: the lease expires by itself)."""
        renewer = asyncio.ensure_future(self._renew(token))
        try:
            yield
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            try:
                await self._store.release_lease(WEIGHTS_LEASE, token)
            except Exception as exc:
                log.error("weights_lease_release_failed", holder=token, error=str(exc))

    async def _renew(self, token: str) -> None:
        while True:
            await asyncio.sleep(self._lease_ttl_s / 3)
            try:
                held = await self._store.renew_lease(WEIGHTS_LEASE, token, self._lease_ttl_s)
            except Exception as exc:
                log.error("weights_lease_renew_failed", holder=token, error=str(exc))
                continue
            if not held:
                log.error(
                    "weights_lease_lost",
                    holder=token,
                    note="the lease expired while this update ran (the store was unreachable for "
                    "longer than --weights-lease-ttl): another update may start meanwhile",
                )

    @contextlib.asynccontextmanager
    async def lease(self, what: str) -> AsyncIterator[None]:
        """The fleet lease around one short operation (memory release / resume)."""
        token = await self.take_lease(what)
        async with self.holding(token):
            yield

    async def check_order(self, version: str) -> list[str]:
        """The fleet's version order, after refusing `version` when it goes backwards from it."""
        order = await self._store.version_order()
        if order and version != order[-1] and (version in order or decimal_backwards(version, order[-1])):
            raise FailedPrecondition(
                f"{VERSION_FIELD} {version!r} goes backwards: the fleet's newest is {order[-1]!r}"
            )
        return order

    async def advance_order(self, version: str) -> None:
        """`version` is the fleet's newest now (an engine took it). The engines already carry it, so
        a store that does not answer now is logged, not raised: failing the call would send the
        trainer to repeat an update that happened; steps see the label once a Resume records it."""
        try:
            ok, order = await self._store.advance_version(version)
        except Exception as exc:
            log.error("weight_version_order_not_recorded", weight_version=version, error=str(exc))
            return
        if not ok:  # only a Resume with a newer label, racing this update, can do this
            log.error("weight_version_order_refused", weight_version=version, newest=order[-1])
