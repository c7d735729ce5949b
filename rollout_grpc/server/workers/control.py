"""Fleet control across the workers of one replica: every control RPC acts on all of them.

A worker's `Control` runs the engine side once, as a replica of its own does (the engines are
shared by every worker), and reaches its siblings through `WorkerService` for what only they hold:

* Abort(all): the siblings count and abort their generations (queued ones too), open the abort-all
  window and answer (`WorkerService.AbortSibling`, target `all`); then this worker pauses/resumes
  the engines;
* abort by id, session, group or `mine`: forwarded like a peer's forward; the counts add up, and
  `unknown_request_ids` lists only ids that no worker knew;
* Pause: the siblings bump their pause epoch (a late resume of theirs must not undo it) and, for
  ABORT, abort their local generations;
* Resume(weight_version): the siblings relabel the engines that took the version, so the weight
  version of every token streamed afterwards is right on every worker;
* UpdateWeights: the same, plus the engines the update took out of rotation or re-admitted.

The RolloutServicer subclass reports the worker count in GetServerInfo. Agent sessions need no
sibling call: they are in the state store every worker reaches (rollout/sessions.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.identity import current_caller
from rollout_grpc.server.front.grpc.service import RolloutServicer
from rollout_grpc.server.rollout.control import (
    PAUSE_MODES,
    AbortResult,
    AbortScope,
    Control,
    FleetResult,
    ForwardedAbort,
)
from rollout_grpc.server.workers.siblings import Siblings

log = structlog.get_logger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
#: Longest Abort(all) waits for the siblings to count their generations before pausing the engines.
SIBLING_MARK_WAIT_S = 1.0


class WorkerControl(Control):
    """`Control` whose aborts, pauses and resumes also reach the sibling workers."""

    siblings: Siblings | None = None

    async def _siblings_abort(self, scope: AbortScope) -> ForwardedAbort:
        if self.siblings is None:
            return ForwardedAbort()
        return await self.siblings.abort(scope)

    async def abort_all(self, *, caller_deadline: float | None = None) -> AbortResult:
        if not current_caller().is_admin:
            return await super().abort_all()  # refused there, before anything happens
        siblings = asyncio.ensure_future(self._siblings_abort(AbortScope(owner=None, everything=True)))
        # The siblings count (and mark) their generations before the engines' pause ends them: a
        # stream the engine already ended would not be counted. A sibling's answer comes before
        # its window is held (`Control.abort_all_local`), so this waits one local call, bounded so
        # that a stuck sibling cannot hold the engines' pause back.
        await asyncio.wait({siblings}, timeout=SIBLING_MARK_WAIT_S)
        try:
            result = await super().abort_all(caller_deadline=caller_deadline)
        finally:
            outcome = await siblings
        result.aborted += outcome.aborted
        return result

    async def abort_ids(self, request_ids: Any) -> AbortResult:
        result = await super().abort_ids(request_ids)
        if result.unknown_request_ids:
            scope = AbortScope(owner=self._scope(), request_ids=tuple(result.unknown_request_ids))
            outcome = await self._siblings_abort(scope)
            result.aborted += outcome.aborted
            result.unknown_request_ids = [
                rid for rid in result.unknown_request_ids if rid not in outcome.found_request_ids
            ]
        return result

    async def abort_matching(
        self, *, session_id: str | None = None, group_index: int | None = None
    ) -> AbortResult:
        if session_id is not None and not session_id:
            raise InvalidArgument("session_id", "must not be empty")
        scope = AbortScope(owner=self._scope(), session_id=session_id, group_index=group_index)
        result, outcome = await asyncio.gather(
            super().abort_matching(session_id=session_id, group_index=group_index),
            self._siblings_abort(scope),
        )
        result.aborted += outcome.aborted
        return result

    async def abort_mine(self) -> AbortResult:
        scope = AbortScope(owner=current_caller().identity, all_of_owner=True)
        result, outcome = await asyncio.gather(super().abort_mine(), self._siblings_abort(scope))
        result.aborted += outcome.aborted
        return result

    async def pause(self, mode: str) -> FleetResult:
        if mode not in PAUSE_MODES or self.siblings is None:
            return await super().pause(mode)
        synced = asyncio.ensure_future(self.siblings.sync_pause(mode))
        try:
            return await super().pause(mode)
        finally:
            await synced

    async def resume(self, weight_version: str | None) -> FleetResult:
        if self.siblings is None or (weight_version is not None and not weight_version):
            return await super().resume(weight_version)
        try:
            return await super().resume(weight_version)
        finally:
            relabelled = (
                [e.url for e in self._pool.engines if e.weight_version == weight_version]
                if weight_version is not None
                else []
            )
            await self.siblings.sync_resume(weight_version, relabelled)

    async def weights_updated(
        self, weight_version: str, relabelled: list[str], rotation: dict[str, str]
    ) -> None:
        if self.siblings is not None:
            await self.siblings.sync_resume(weight_version, relabelled, rotation)

    async def abort_local(self, scope: AbortScope) -> AbortResult:
        """A peer replica's forwarded abort: this worker's generations and every sibling's."""
        result = await super().abort_local(scope)
        outcome = await self._siblings_abort(scope)
        result.aborted += outcome.aborted
        if scope.request_ids:
            result.unknown_request_ids = [
                rid for rid in result.unknown_request_ids if rid not in outcome.found_request_ids
            ]
        return result

    async def abort_local_only(self, scope: AbortScope) -> AbortResult:
        """A sibling's abort: this worker's generations only (never forwarded again)."""
        return await super().abort_local(scope)

    def sibling_paused(self, mode: str) -> int:
        """A sibling ran Pause(`mode`) on the engines: the local part; generations aborted."""
        self._pause_epoch += 1
        if mode != "abort":
            return 0
        local = self._registry.all()
        for entry in local:
            entry.request_abort("pause abort")
        return len(local)


async def _no_loads() -> list[pb.SiblingLoadResponse]:
    return []


class WorkerRolloutServicer(RolloutServicer):
    """RolloutService of a worker: the worker count and the whole replica's load in GetServerInfo."""

    siblings: Siblings | None = None
    workers: int = 1
    index: int = 0

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.GetServerInfoResponse:
        urls = self._facade.engine_urls()
        response, loads = await asyncio.gather(
            super().GetServerInfo(request, context),
            self.siblings.load() if self.siblings is not None else _no_loads(),
        )
        response.workers = self.workers
        response.worker = self.index
        # The whole replica's load, as a single process would report it.
        for load in loads:
            response.in_flight += load.in_flight
            response.queued += load.queued
            if len(urls) == len(response.engines):
                for url, info in zip(urls, response.engines, strict=True):
                    info.in_flight += load.engine_in_flight.get(url, 0)
        return response
