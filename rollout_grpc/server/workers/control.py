"""What a worker's RolloutService adds: GetTrajectory from worker 0, the replica's load.

Fleet control across the workers (every Abort, Pause and Resume a worker receives also reaching
its siblings) is no subclass any more: the worker's `Control` is the replica's, given the siblings
as one of its fanouts (`workers/siblings.Siblings`, rollout/fanout.py), wired in `worker.py`:

* Abort(all): the siblings count and abort their generations (queued ones too), open the abort-all
  window and answer (`WorkerService.AbortSibling`, target `all`); then this worker pauses/resumes
  the engines;
* abort by id, session, group or `mine`: forwarded like a peer's forward; the counts add up, and
  `unknown_request_ids` lists only ids that no worker knew (with `--state-store redis://...` the
  store carries these to every worker instead);
* Pause: the siblings bump their pause epoch (a late resume of theirs must not undo it) and, for
  ABORT, abort their local generations;
* Resume(weight_version) and UpdateWeights: the siblings relabel the engines that took the version
  (and take the rotation changes of an update), so the weight version of every token streamed
  afterwards is right on every worker.

The RolloutServicer subclass here forwards GetTrajectory to worker 0 (which runs the front door and
so records every session) and reports the worker count in GetServerInfo.
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
from rollout_grpc.server.workers.siblings import Siblings

log = structlog.get_logger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
#: The worker that runs the OpenAI front door and holds the recorded sessions.
FRONT_DOOR_WORKER = 0


async def _no_loads() -> list[pb.SiblingLoadResponse]:
    return []


#: Codes of a SiblingTrajectory that did not reach worker 0's servicer (gRPC's text, not worker 0's).
_UNREACHED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED})
_UNREACHED_MESSAGE = (
    "worker 0 of this replica, which records the front door's sessions, did not answer; retry"
)
#: Trailers of worker 0's status that the caller needs: the rich status and the retry pushback.
_FORWARDED_TRAILERS = frozenset({"grpc-status-details-bin", "grpc-retry-pushback-ms"})


def forwarded_status(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]]:
    """What the caller gets for worker 0's failed SiblingTrajectory: (code, details, trailers).

    Worker 0's own answers pass whole, with the trailers that carry the rich status (a field
    violation, a retry delay). A failure to reach it at all (UNAVAILABLE, UNKNOWN, CANCELLED) has
    gRPC's transport text, which names the internal socket: the caller gets a message of ours.
    """
    code = exc.code()
    if code in _UNREACHED:
        log.warning("sibling_trajectory_failed", code=code.name, error=exc.details())
        return grpc.StatusCode.UNAVAILABLE, _UNREACHED_MESSAGE, ()
    trailers = tuple(
        (key, value) for key, value in (exc.trailing_metadata() or ()) if key in _FORWARDED_TRAILERS
    )
    return code, exc.details() or "", trailers


class WorkerRolloutServicer(RolloutServicer):
    """RolloutService of a worker: GetTrajectory from worker 0, the worker count in GetServerInfo."""

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

    async def GetTrajectory(
        self, request: pb.GetTrajectoryRequest, context: Context
    ) -> pb.GetTrajectoryResponse:
        if self.index == FRONT_DOOR_WORKER or self.siblings is None:
            return await self.local_trajectory(request, context)
        if not request.session_id:
            raise InvalidArgument("session_id", "must not be empty")
        try:
            return await self.siblings.trajectory(
                FRONT_DOOR_WORKER, request, current_caller(), timeout_s=context.time_remaining()
            )
        except grpc.aio.AioRpcError as exc:
            await context.abort(*forwarded_status(exc))
            raise

    async def local_trajectory(
        self, request: pb.GetTrajectoryRequest, context: Context
    ) -> pb.GetTrajectoryResponse:
        """This worker's own GetTrajectory (worker 0's, for its siblings)."""
        return await super().GetTrajectory(request, context)
