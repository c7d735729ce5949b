"""Calls to the sibling workers of this replica (`rollout.v1.WorkerService` on their unix sockets).

A sibling is a peer that is always present: every Abort, Pause and Resume a worker receives is
also applied to the others, `Siblings` being one of the fanouts `Control` calls (rollout/fanout.py).
Calls present the per-start secret and wait for a sibling that is still starting
(`wait_for_ready`), each bounded by the control deadline; a sibling that fails is logged and left
out of the counts (its supervisor stops the replica if it died).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server.facade.values import AbortScope, ForwardedAbort
from rollout_grpc.server.front.grpc.replica import abort_request
from rollout_grpc.server.workers.handshake import SIBLING_METADATA_KEY, WorkerSpec

log = structlog.get_logger(__name__)

T = TypeVar("T")


class Siblings:
    """Channels to every other worker of this replica, opened at start and kept."""

    def __init__(self, spec: WorkerSpec, timeout_s: float, *, store_carries_aborts: bool = False) -> None:
        self.spec = spec
        #: With a fleet bus (`--state-store redis://...`) every worker receives a fleet abort from
        #: the store itself: the siblings then get only a `--peer` forward's relay from here.
        self.store_carries_aborts = store_carries_aborts
        self._timeout_s = timeout_s
        self._metadata = ((SIBLING_METADATA_KEY, spec.secret),)
        self._channels = {
            i: grpc.aio.insecure_channel(spec.sibling_address(i))
            for i in range(spec.workers)
            if i != spec.index
        }
        self._stubs = {i: pb_grpc.WorkerServiceStub(c) for i, c in self._channels.items()}

    def stub(self, index: int) -> pb_grpc.WorkerServiceStub:
        """The stub of sibling `index`."""
        return self._stubs[index]

    async def _each(
        self, what: str, call: Callable[[pb_grpc.WorkerServiceStub], object]
    ) -> list[tuple[int, T]]:
        """Run `call` on every sibling concurrently; the answers of those that answered."""
        indexes = list(self._stubs)
        results = await asyncio.gather(
            *(cast(Awaitable[T], call(self._stubs[i])) for i in indexes), return_exceptions=True
        )
        answered: list[tuple[int, T]] = []
        for index, result in zip(indexes, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                log.warning("sibling_call_failed", call=what, worker=index, error=str(result))
            else:
                answered.append((index, result))
        return answered

    async def abort(self, scope: AbortScope, *, within_replica: bool = False) -> ForwardedAbort:
        """Abort `scope` on every sibling; what they aborted and which ids they knew (a `Fanout`,
        rollout/fanout.py). Skipped when the store carries the fleet's aborts to them already."""
        if self.store_carries_aborts and not within_replica:
            return ForwardedAbort()
        request = pb.AbortSiblingRequest(abort=abort_request(scope))
        answers: list[tuple[int, pb.AbortSiblingResponse]] = await self._each(
            "AbortSibling",
            lambda stub: stub.AbortSibling(
                request, timeout=self._timeout_s, metadata=self._metadata, wait_for_ready=True
            ),
        )
        outcome = ForwardedAbort()
        for _, answer in answers:
            outcome.aborted += answer.result.aborted
            outcome.found_request_ids.update(answer.result.found_request_ids)
        return outcome

    async def paused(self, mode: str) -> int:
        """Tell every sibling a Pause ran in `mode`; the generations they aborted (ABORT)."""
        request = pb.SyncControlRequest(pause=pb.PauseMode.Value("PAUSE_MODE_" + mode.upper()))
        answers: list[tuple[int, pb.SyncControlResponse]] = await self._each(
            "SyncControl",
            lambda stub: stub.SyncControl(
                request, timeout=self._timeout_s, metadata=self._metadata, wait_for_ready=True
            ),
        )
        return sum(answer.aborted for _, answer in answers)

    async def resumed(
        self, weight_version: str | None, relabelled: list[str], rotation: dict[str, str] | None = None
    ) -> None:
        """Tell every sibling a Resume (or a weight update) ran, which engines took
        `weight_version`, and the rotation changes of a weight update (engine -> problem)."""
        request = pb.SyncControlRequest(
            resume=pb.ResumeSync(
                weight_version=weight_version or "",
                relabelled_engines=relabelled,
                rotation=[
                    pb.EngineRotation(engine=url, problem=why) for url, why in (rotation or {}).items()
                ],
            )
        )
        await self._each(
            "SyncControl",
            lambda stub: stub.SyncControl(
                request, timeout=self._timeout_s, metadata=self._metadata, wait_for_ready=True
            ),
        )

    async def load(self) -> list[pb.SiblingLoadResponse]:
        """Every answering sibling's generations in flight and queued."""
        request = pb.SiblingLoadRequest()
        answers: list[tuple[int, pb.SiblingLoadResponse]] = await self._each(
            "SiblingLoad",
            lambda stub: stub.SiblingLoad(
                request, timeout=self._timeout_s, metadata=self._metadata, wait_for_ready=True
            ),
        )
        return [answer for _, answer in answers]

    async def close(self) -> None:
        """Close the channels."""
        await asyncio.gather(*(c.close() for c in self._channels.values()))
