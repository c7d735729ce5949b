"""What a worker's RolloutService adds: the replica's load and worker count.

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

The RolloutServicer subclass reports the worker count in GetServerInfo. Agent sessions need no
sibling call: they are in the state store every worker reaches (rollout/sessions.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.front.grpc.service import RolloutServicer
from rollout_grpc.server.workers.siblings import Siblings

log = structlog.get_logger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


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
