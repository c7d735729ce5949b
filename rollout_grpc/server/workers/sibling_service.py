"""A worker's private server: `rollout.v1.WorkerService` on a unix socket, for its siblings only.

Bound to `<run dir>/worker-<i>.sock` in the supervisor's 0700 directory (only this user reaches
it), and every call must present the per-start sibling secret (compared in constant time):
that secret is the "sibling" role, and this server serves WorkerService and nothing else, so it
grants no RolloutService call. Domain errors map to gRPC statuses as on the main port
(`front/grpc/status.py`).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
import structlog

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server.domain.errors import InvalidArgument, RolloutError
from rollout_grpc.server.domain.identity import Caller, Role, reset_caller, set_caller
from rollout_grpc.server.domain.vocabulary import PauseMode
from rollout_grpc.server.facade.door import RolloutFacade
from rollout_grpc.server.facade.values import AbortResult, AbortScope
from rollout_grpc.server.front.grpc.replica import abort_response, abort_scope
from rollout_grpc.server.front.grpc.status import to_status
from rollout_grpc.server.observe.metrics import Metrics
from rollout_grpc.server.workers.handshake import SIBLING_METADATA_KEY

log = structlog.get_logger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


class SiblingHost(Protocol):
    """What the sibling calls act on: the worker's server (workers/worker.py)."""

    @property
    def facade(self) -> RolloutFacade: ...
    @property
    def metrics(self) -> Metrics: ...
    def sibling_paused(self, mode: str) -> int: ...
    async def abort_local_only(self, scope: AbortScope) -> AbortResult: ...
    def load(self) -> pb.SiblingLoadResponse: ...
    def sibling_resumed(
        self, weight_version: str | None, relabelled: list[str], rotation: dict[str, str] | None = None
    ) -> None: ...


class _SecretCheck(grpc.aio.ServerInterceptor):
    """Refuse every call without the sibling secret (UNAUTHENTICATED, before the handler)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == SIBLING_METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else bytes(value)
        if hmac.compare_digest(presented, self._secret):
            return await continuation(handler_call_details)
        return grpc.unary_unary_rpc_method_handler(_refuse)


async def _refuse(request: object, context: Context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "sibling calls need the sibling secret")


async def _domain_errors(context: Context, call: Awaitable[Any]) -> Any:
    try:
        return await call
    except RolloutError as exc:
        await context.abort_with_status(to_status(exc))


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """The sibling calls, on top of this worker's server."""

    def __init__(self, server: SiblingHost) -> None:
        self._server = server

    async def AbortSibling(
        self, request: pb.AbortSiblingRequest, context: Context
    ) -> pb.AbortSiblingResponse:
        # Siblings act for the replica itself: any owner's generations when `owner` is empty.
        token = set_caller(Caller(identity="sibling", role=Role.ADMIN))
        try:
            response: pb.AbortSiblingResponse = await _domain_errors(context, self._abort(request))
        finally:
            reset_caller(token)
        return response

    async def _abort(self, request: pb.AbortSiblingRequest) -> pb.AbortSiblingResponse:
        scope = abort_scope(request.abort)
        result = await self._server.abort_local_only(scope)
        return pb.AbortSiblingResponse(result=abort_response(scope, result))

    async def SiblingLoad(self, request: pb.SiblingLoadRequest, context: Context) -> pb.SiblingLoadResponse:
        return self._server.load()

    async def SyncControl(self, request: pb.SyncControlRequest, context: Context) -> pb.SyncControlResponse:
        action = request.WhichOneof("action")
        if action == "pause":
            name = pb.PauseMode.Name(request.pause).removeprefix("PAUSE_MODE_").lower()
            if name not in set(PauseMode):
                await context.abort_with_status(
                    to_status(InvalidArgument("pause", "must be ABORT, WAIT or KEEP"))
                )
            return pb.SyncControlResponse(aborted=self._server.sibling_paused(name))
        if action == "resume":
            self._server.sibling_resumed(
                request.resume.weight_version or None,
                list(request.resume.relabelled_engines),
                {r.engine: r.problem for r in request.resume.rotation},
            )
            return pb.SyncControlResponse()
        await context.abort_with_status(to_status(InvalidArgument("action", "set pause or resume")))
        raise AssertionError("unreachable")  # abort raises

    async def SiblingTrajectory(
        self, request: pb.SiblingTrajectoryRequest, context: Context
    ) -> pb.SiblingTrajectoryResponse:
        # Deprecated: sessions are in the state store, which every worker reads itself.
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "sessions are in the state store; no worker forwards them"
        )
        raise AssertionError("unreachable")  # abort raises

    async def Scrape(self, request: pb.ScrapeRequest, context: Context) -> pb.ScrapeResponse:
        return pb.ScrapeResponse(text=self._server.metrics.exposition())


async def start_sibling_server(server: SiblingHost, address: str, secret: str) -> grpc.aio.Server:
    """Serve WorkerService on `address` (a `unix:` path) for the siblings."""
    sibling = grpc.aio.server(interceptors=[_SecretCheck(secret)])
    pb_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(server), sibling)
    if sibling.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot listen on {address} (the worker's sibling socket)")
    await sibling.start()
    return sibling
