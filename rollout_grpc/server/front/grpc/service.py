"""The gRPC servicer: transport only (proto <-> domain, request ids), over the facade.

Every RPC calls the transport-neutral `RolloutFacade` (the OpenAI front door calls the same one)
and records into the call's `CallRecord`, which the per-call wrapper (`interceptor.py`) opened and
closes; the wrapper also maps every exception to its status code.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import structlog

from rollout_grpc import __version__
from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server.domain import model as domain
from rollout_grpc.server.domain import trajectory
from rollout_grpc.server.domain.errors import InvalidArgument, NotFound
from rollout_grpc.server.domain.identity import current_caller
from rollout_grpc.server.domain.vocabulary import PauseMode
from rollout_grpc.server.facade.calls import CURRENT_CALL, CallRecord, Door
from rollout_grpc.server.facade.door import RolloutFacade
from rollout_grpc.server.facade.values import (
    AbortResult,
    CheckpointSource,
    DistributedSource,
    MemoryRelease,
    StepCounts,
    TensorSpec,
    TransferGroup,
    WeightUpdate,
)
from rollout_grpc.server.front.grpc import convert, redaction
from rollout_grpc.server.front.grpc.engine_info import engine_info_extras
from rollout_grpc.server.security import redact

log = structlog.get_logger(__name__)

#: Request ids: 1-256 characters safe in gRPC metadata, HTTP bodies and logs. `~` is excluded (it
#: separates the parts of engine call ids, rollout/call_ids.py, which escapes it anyway).
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,256}")
REQUEST_ID_RULE = "must be 1-256 characters of A-Z a-z 0-9 . _ : / @ + = -"
#: A step id's length bound: its samples' request ids are `<step id>/g<group>/s<i>[/r]`.
MAX_STEP_ID = 200


def check_request_id(request_id: str, field: str) -> None:
    """INVALID_ARGUMENT naming `field` unless `request_id` follows REQUEST_ID."""
    if REQUEST_ID.fullmatch(request_id) is None:
        raise InvalidArgument(field, f"{REQUEST_ID_RULE}; got {request_id[:64]!r}")


def _caller_deadline(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    """When the caller stops waiting, on the `time.monotonic()` clock (None: no deadline)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


#: The proto's pause modes by name (`domain/vocabulary.PauseMode`); UNSPECIFIED is refused.
_PAUSE_MODES = {pb.PauseMode.Value("PAUSE_MODE_" + mode.name): mode.value for mode in PauseMode}
_PAUSE_MODE_NAMES = ", ".join(mode.name for mode in PauseMode)


def engine_errors_to_pb(pairs: list[tuple[str, str]]) -> list[pb.EngineError]:
    """`(engine URL, error)` pairs of a fleet operation as `rollout.v1.EngineError`s."""
    return [pb.EngineError(engine=url, error=err) for url, err in pairs]


def current_record(method: str) -> CallRecord:
    """The record the per-call wrapper opened for this call (a detached one without it)."""
    return CURRENT_CALL.get() or CallRecord(Door.GRPC, method)


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """Implements rollout.v1.RolloutService on top of the domain objects."""

    def __init__(
        self,
        facade: RolloutFacade,
        default_options: domain.GenerateOptions | None = None,
        *,
        simulated_engines: bool = False,
    ) -> None:
        self._simulated_engines = simulated_engines
        self._facade = facade
        self._defaults = default_options or domain.GenerateOptions()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        record = current_record("Generate")
        request_id = request.request_id or uuid.uuid4().hex
        record.request_id = request_id
        record.sample_index = request.sample.index
        check_request_id(request_id, "request_id")
        sample = convert.sample_from_pb(request.sample)
        params = convert.sampling_params_from_pb(request.sampling_params)
        options = convert.options_from_pb(request.options, self._defaults)
        remaining = context.time_remaining()
        if remaining is not None:
            # The deadline goes down as a domain value: the sample is sent before it expires.
            options.deadline = time.monotonic() + remaining
        headers_sent = False
        async for event in self._facade.generate(record, sample, params, options, request_id):
            if not headers_sent:
                # Headers go out with the first message, not before: until then every refusal
                # (shutting down, queue full, no engine) is a trailers-only response that client
                # retry policies and proxies may retry on another replica.
                await context.send_initial_metadata((("x-request-id", request_id),))
                headers_sent = True
            if type(event) is domain.TokenBatch:
                yield convert.delta_to_pb(event)
            else:
                final = convert.sample_to_pb(event, request.sample)  # type: ignore[arg-type]
                if not current_caller().is_admin:
                    redaction.redact_sample(final)
                yield pb.GenerateResponse(sample=final)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortResponse:
        record = current_record("Abort")
        target = request.WhichOneof("target")
        record.abort_target = target or "none"
        if target is None:
            raise InvalidArgument("target", "set one of all, mine, request_ids, session_id, group_index")
        result = await self._abort_target(request, record, target, _caller_deadline(context))
        response = pb.AbortResponse(
            aborted=result.aborted,
            unknown_request_ids=result.unknown_request_ids,
            engine_errors=engine_errors_to_pb(result.engine_errors),
        )
        if not current_caller().is_admin:
            redaction.redact_engine_errors(list(response.engine_errors))
        return response

    async def _abort_target(
        self, request: pb.AbortRequest, record: CallRecord, target: str, caller_deadline: float | None
    ) -> AbortResult:
        """Run the abort the request's target names (Abort(all) answers before `caller_deadline`)."""
        if target == "mine":
            if not request.mine:
                raise InvalidArgument("mine", "must be true when it is the target")
            result = await self._facade.abort_mine(record)
        elif target == "all":
            if not request.all:
                raise InvalidArgument("all", "must be true when it is the target")
            result = await self._facade.abort_all(record, caller_deadline)
        elif target == "request_ids":
            for i, rid in enumerate(request.request_ids.ids):
                if rid:  # empty ids are refused as a whole by Control.abort_ids
                    check_request_id(rid, f"request_ids.ids[{i}]")
            result = await self._facade.abort_ids(record, list(request.request_ids.ids))
        elif target == "session_id":
            result = await self._facade.abort_matching(record, session_id=request.session_id)
        else:
            result = await self._facade.abort_matching(record, group_index=request.group_index)
        return result

    def _precheck_step(self, request: pb.RolloutStepRequest) -> None:
        """Counts and lengths read on the wire message, before anything is converted: converting
        100,000 groups took the event loop 2-4 s before the refusal, and a 1M-token prompt was
        copied per sample before any length check (its engines would refuse it anyway)."""
        steps = self._facade.steps
        if steps is None:
            return
        steps.precheck(
            StepCounts(
                request.n_samples_per_prompt,
                len(request.groups),
                request.target_groups,
                request.max_groups_in_flight,
                request.continue_buffered,
            )
        )
        limit = steps.prompt_token_limit()
        for i, group in enumerate(request.groups):
            if len(group.prompt.tokens) >= limit:
                raise InvalidArgument(
                    f"groups[{i}].prompt.tokens",
                    f"{len(group.prompt.tokens)} tokens leave no room to generate under the engines' "
                    f"max_model_len={limit}",
                )
            for j, partial in enumerate(group.partial):
                if len(partial.tokens) > limit:
                    raise InvalidArgument(
                        f"groups[{i}].partial[{j}].tokens",
                        f"{len(partial.tokens)} tokens, over the engines' max_model_len={limit}",
                    )

    async def RolloutStep(
        self, request: pb.RolloutStepRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.RolloutStepResponse]:
        record = current_record("RolloutStep")
        check_request_id(request.step_id, "step_id")
        if len(request.step_id) > MAX_STEP_ID:
            raise InvalidArgument(
                "step_id", f"at most {MAX_STEP_ID} characters (sample request ids extend it)"
            )
        self._precheck_step(request)
        spec = convert.step_spec_from_pb(request, self._defaults)
        redact_samples = not current_caller().is_admin
        async for event in self._facade.rollout_step(record, spec):
            message = convert.step_event_to_pb(event)
            kind = message.WhichOneof("event")
            if redact_samples and kind == "sample":
                redaction.redact_sample(message.sample)
            elif redact_samples and kind == "group":
                for sample in message.group.samples:
                    redaction.redact_sample(sample)
            yield message

    async def Pause(
        self, request: pb.PauseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PauseResponse:
        mode = _PAUSE_MODES.get(request.mode)
        if mode is None:
            raise InvalidArgument("mode", f"must be {_PAUSE_MODE_NAMES}; got {int(request.mode)}")
        result = await self._facade.pause(current_record("Pause"), mode)
        return pb.PauseResponse(paused_engines=result.ok, engine_errors=engine_errors_to_pb(result.errors))

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ResumeResponse:
        version = request.weight_version if request.HasField("weight_version") else None
        result = await self._facade.resume(current_record("Resume"), version)
        return pb.ResumeResponse(resumed_engines=result.ok, engine_errors=engine_errors_to_pb(result.errors))

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.UpdateWeightsResponse:
        mode = _PAUSE_MODES.get(request.pause_mode)
        if mode is None:
            raise InvalidArgument("pause_mode", f"must be {_PAUSE_MODE_NAMES}; got {int(request.pause_mode)}")
        kind = request.WhichOneof("source")
        source: CheckpointSource | DistributedSource
        if kind == "checkpoint":
            source = CheckpointSource(path=request.checkpoint.path)
        elif kind == "distributed":
            d = request.distributed
            group = TransferGroup(
                backend=d.backend,
                master_address=d.master_address,
                master_port=d.master_port,
                group_name=d.group_name or "weight_update_group",
                world_size=d.world_size,
            )
            tensors = tuple(TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in d.tensors)
            source = DistributedSource(group=group, tensors=tensors)
        else:
            raise InvalidArgument(
                "source", f"must be set to one of: checkpoint, distributed; got {kind or 'nothing'}"
            )
        update = WeightUpdate(
            source=source,
            weight_version=request.weight_version,
            pause_mode=mode,
            all_at_once=request.all_at_once,
        )
        result = await self._facade.update_weights(current_record("UpdateWeights"), update)
        return pb.UpdateWeightsResponse(
            weight_version=result.weight_version,
            previous_versions=result.previous_versions,
            engines=[
                pb.EngineWeightOutcome(engine=e.url, updated=e.updated, error=e.error) for e in result.engines
            ],
            paused_seconds=result.paused_s,
            load_seconds=result.load_s,
            retry=result.retry,
        )

    async def PlanWeightTransfer(
        self, request: pb.PlanWeightTransferRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PlanWeightTransferResponse:
        plan = await self._facade.plan_transfer(
            current_record("PlanWeightTransfer"), request.trainer_ranks or 1
        )
        return pb.PlanWeightTransferResponse(
            world_size=plan.world_size,
            engines=[
                pb.EngineRanks(engine=url, rank_offset=offset, ranks=n) for url, offset, n in plan.engines
            ],
        )

    async def ReleaseMemory(
        self, request: pb.ReleaseMemoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReleaseMemoryResponse:
        level = request.level if request.HasField("level") else 1
        release = MemoryRelease(level=level, tags=tuple(request.tags))
        result = await self._facade.release_memory(current_record("ReleaseMemory"), release)
        return pb.ReleaseMemoryResponse(
            released_engines=result.ok, engine_errors=engine_errors_to_pb(result.errors)
        )

    async def ResumeMemory(
        self, request: pb.ResumeMemoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ResumeMemoryResponse:
        result, generating = await self._facade.resume_memory(
            current_record("ResumeMemory"), tuple(request.tags)
        )
        return pb.ResumeMemoryResponse(
            resumed_engines=result.ok, engine_errors=engine_errors_to_pb(result.errors), generating=generating
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        server = await self._facade.server_info()
        statuses = server.engines
        show_url = current_caller().is_admin
        versions = {s.weight_version for s in statuses if s.healthy and s.weight_version}
        response = pb.GetServerInfoResponse(
            engines=[
                pb.EngineInfo(
                    url=s.url if show_url else redact.engine_label(s.url),
                    healthy=s.healthy,
                    paused=s.paused,
                    weight_version=s.weight_version,
                    in_flight=s.in_flight,
                    draining=s.draining,
                    model=s.model,
                    **engine_info_extras(s),
                )
                for s in statuses
            ],
            simulated_engines=self._simulated_engines,
            paused=any(s.paused for s in statuses),
            weight_version=versions.pop() if len(versions) == 1 else "",
            in_flight=server.in_flight,
            queued=server.queued,
            version=__version__,
        )
        if not show_url:
            urls = [s.url for s in statuses]
            for info in response.engines:
                info.health_error = redact.redact_text(info.health_error, urls)
        return response

    async def Render(
        self, request: pb.RenderRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RenderResponse:
        kind = request.WhichOneof("prompt")
        template_kwargs = (
            convert.struct_from_pb(request.chat_template_kwargs, "chat_template_kwargs")
            if request.HasField("chat_template_kwargs")
            else {}
        )
        add_generation_prompt = (
            request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        )
        if kind == "chat":
            messages = [
                (
                    m.role,
                    [
                        convert.content_part_from_pb(p, f"chat.messages[{i}].content[{j}]")
                        for j, p in enumerate(m.content)
                    ],
                )
                for i, m in enumerate(request.chat.messages)
            ]
            rendered = await self._facade.render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=template_kwargs,
                session_id=request.session_id,
                model=request.model,
            )
        elif kind == "text":
            rendered = await self._facade.render_text(
                request.text, session_id=request.session_id, model=request.model
            )
        else:
            raise InvalidArgument("prompt", "set chat or text")
        engine = rendered.engine if current_caller().is_admin else redact.engine_label(rendered.engine)
        response = pb.RenderResponse(token_ids=rendered.token_ids, engine=engine)
        if rendered.features:
            convert.features_to_pb(rendered.features, response.features)
        return response

    async def GetTrajectory(
        self, request: pb.GetTrajectoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetTrajectoryResponse:
        if not request.session_id:
            raise InvalidArgument("session_id", "must not be empty")
        caller = current_caller()
        # Another caller's session reads as missing (admins read every session); a running turn
        # of this process is waited for: recorded whole or not at all.
        session = await self._facade.session(request.session_id, caller, remove=request.remove)
        if session is None:
            raise NotFound(f"session {request.session_id!r} is not recorded")
        samples, turn_samples = trajectory.to_samples_indexed(session)
        original = pb.Sample(session_id=request.session_id)
        finals = [convert.sample_to_pb(s, original) for s in samples]
        if not caller.is_admin:
            for final in finals:
                redaction.redact_sample(final)
        return pb.GetTrajectoryResponse(
            samples=finals,
            turns=[
                pb.TrajectoryTurn(
                    request_id=t.request_id,
                    prompt_token_ids=t.prompt_ids,
                    response_token_ids=t.response_ids,
                    response_logprobs=t.logprobs,
                    weight_versions=[
                        pb.WeightVersionSpan(version=w.version, start=w.start, end=w.end)
                        for w in t.weight_versions
                    ],
                    finish_reason=int(t.finish),  # type: ignore[arg-type]
                    tool_calls_json=[orjson.dumps(c).decode() for c in t.tool_calls],
                    sample_index=index,
                    drift=t.drift,
                )
                for t, index in zip(session.turns, turn_samples, strict=True)
            ],
        )
