"""The internal replica-to-replica service (`rollout.v1.ReplicaService`): transport only.

Only the `peer` and `admin` roles may call it (enforced by the per-call wrapper,
`interceptor.py`); the forwarded abort carries the original caller's identity as `owner`, so a
peer ends only that caller's work.
"""

from __future__ import annotations

from typing import Any

import grpc

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.facade.door import RolloutFacade
from rollout_grpc.server.facade.values import AbortResult, AbortScope
from rollout_grpc.server.front.grpc.service import engine_errors_to_pb


class ReplicaServicer(pb_grpc.ReplicaServiceServicer):
    """Implements rollout.v1.ReplicaService on top of the facade."""

    def __init__(self, facade: RolloutFacade) -> None:
        self._facade = facade

    async def AbortLocal(
        self, request: pb.AbortLocalRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortLocalResponse:
        scope = abort_scope(request)
        return abort_response(scope, await self._facade.abort_local(scope))


def abort_scope(request: pb.AbortLocalRequest) -> AbortScope:
    """The scope a forwarded abort names (exactly one target; INVALID_ARGUMENT naming it otherwise)."""
    owner = request.owner or None
    target = request.WhichOneof("target")
    if target == "request_ids":
        if not request.request_ids.ids:
            raise InvalidArgument("request_ids.ids", "must list at least one request id")
        return AbortScope(owner=owner, request_ids=tuple(request.request_ids.ids))
    if target == "session_id":
        return AbortScope(owner=owner, session_id=request.session_id)
    if target == "group_index":
        return AbortScope(owner=owner, group_index=request.group_index)
    if target == "owner_all":
        if not request.owner_all:
            raise InvalidArgument("owner_all", "must be true when it is the target")
        return AbortScope(owner=owner, all_of_owner=True)
    if target == "all":
        if not request.all:
            raise InvalidArgument("all", "must be true when it is the target")
        return AbortScope(owner=owner, everything=True)
    raise InvalidArgument("target", "set one of request_ids, session_id, group_index, owner_all, all")


def abort_request(scope: AbortScope) -> pb.AbortLocalRequest:
    """The AbortLocal request naming `scope` (the inverse of `abort_scope`), for a peer or a sibling."""
    request = pb.AbortLocalRequest(owner=scope.owner or "")
    if scope.everything:
        request.all = True
    elif scope.all_of_owner:
        request.owner_all = True
    elif scope.request_ids:
        request.request_ids.ids.extend(scope.request_ids)
    elif scope.session_id is not None:
        request.session_id = scope.session_id
    else:
        request.group_index = scope.group_index or 0
    return request


def abort_response(scope: AbortScope, result: AbortResult) -> pb.AbortLocalResponse:
    """The answer to a forwarded abort: what was aborted and, for ids, which ids were found."""
    errors = engine_errors_to_pb(result.engine_errors)
    response = pb.AbortLocalResponse(aborted=result.aborted, engine_errors=errors)
    if scope.request_ids:
        # The ids found here: those the forwarding replica must not report as unknown.
        unknown = set(result.unknown_request_ids)
        response.found_request_ids.extend(i for i in dict.fromkeys(scope.request_ids) if i not in unknown)
    return response
