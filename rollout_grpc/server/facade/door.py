"""The transport-neutral door: what both front doors call, and where every call is recorded.

MLServer's data-plane shape: the gRPC servicer and the OpenAI front door are thin translators of
their wire formats; they open a `CallRecord` here (`CallBook.open`), call the data plane
(`RolloutFacade`: generate, abort, pause, resume, server info, render, trajectories) with domain
values, and close the record (`CallBook.close`), which produces the call's log line and metrics
once, for either door. Nothing here knows protobuf, gRPC or HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence

import structlog

from rollout_grpc.server.domain.chat import ChatRenderRequest, ServedModel
from rollout_grpc.server.domain.errors import FailedPrecondition, Unavailable
from rollout_grpc.server.domain.identity import Caller
from rollout_grpc.server.domain.model import GenerateOptions, Sample, SamplingParams, TokenBatch
from rollout_grpc.server.domain.trajectory import Session, Turn
from rollout_grpc.server.engines.api import EngineError
from rollout_grpc.server.engines.pool import EngineHandle
from rollout_grpc.server.facade.calls import CURRENT_CALL, CallRecord, Door, Listener
from rollout_grpc.server.facade.views import CapabilityView, EngineView, ServerView
from rollout_grpc.server.rollout.control import AbortResult, AbortScope, Control, EngineStatus, FleetResult
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.render import Part, Rendered, RenderService
from rollout_grpc.server.rollout.sessions import Sessions
from rollout_grpc.server.rollout.step.events import GroupEnded, StepEvent, Summary
from rollout_grpc.server.rollout.step.runner import StepRunner
from rollout_grpc.server.rollout.step.spec import Outcome, StepSpec
from rollout_grpc.server.rollout.weights import (
    MemoryRelease,
    TransferPlan,
    WeightUpdate,
    WeightUpdateResult,
    WeightUpdates,
)

log = structlog.get_logger(__name__)


class CallBook:
    """Opens and closes call records; a closed record goes to every listener."""

    def __init__(self, listeners: Sequence[Listener] = ()) -> None:
        #: Called with every closed record (the log line, the metrics; tests add their own).
        self.listeners: list[Listener] = list(listeners)

    def open(self, door: Door, method: str) -> CallRecord:
        """A new record, made the current task's call (the admission queue wait, the engine-call
        log and traces find it there). It is never reset: each call runs in a task of its own."""
        record = CallRecord(door, method)
        CURRENT_CALL.set(record)
        return record

    def close(self, record: CallRecord, code: str = "OK", details: str = "") -> None:
        """End the record with its outcome and report it."""
        record.ended = time.monotonic()
        record.code = code
        record.details = details if code != "OK" else record.details
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:  # an observer bug must never fail the call
                log.exception("call_listener_failed", method=record.method)


class RolloutFacade:
    """The data plane of a replica, in domain terms, for both front doors."""

    def __init__(
        self,
        rollout: Rollout,
        control: Control,
        renderer: RenderService,
        *,
        trajectories: Sessions | None = None,
        calls: CallBook | None = None,
        steps: StepRunner | None = None,
        weights: WeightUpdates | None = None,
    ) -> None:
        self._rollout = rollout
        #: UpdateWeights; None: the RPC answers FAILED_PRECONDITION.
        self._weights = weights
        #: Rollout steps (RolloutStep); None: the RPC answers UNIMPLEMENTED-like FAILED_PRECONDITION.
        self.steps = steps
        self._control = control
        self._renderer = renderer
        self.trajectories = trajectories
        self.calls = calls or CallBook()

    # ----------------------------------------------------------------------------- generation

    def generate(
        self,
        record: CallRecord,
        sample: Sample,
        params: SamplingParams,
        options: GenerateOptions,
        request_id: str,
    ) -> AsyncIterator[TokenBatch | Sample]:
        """One sample's generation (`Rollout.generate`), observed into `record`: its identity,
        the first token's time and the final sample.

        The rollout's own iterator, observed through its callbacks, not a generator re-yielding
        every message: each streamed message resumes every generator of the chain
        (bench/profile_notes.md, thirteenth pass)."""
        record.request_id = request_id
        record.session_id = sample.session_id
        record.group_index = sample.group_index
        record.prior_response_length = sample.response_length
        record.prior_attempts = len(sample.engine_attempts)

        def on_sample(final: Sample) -> None:
            record.sample = final
            if record.ttft_s is None and record.new_tokens > 0:
                record.mark_token()

        # The time to first token is the engine's first token, whatever the caller asked for (a
        # `final_only` caller gets no batch, and its TTFT would be its whole latency).
        return self._rollout.generate(
            sample, params, options, request_id, on_first_token=record.mark_token, on_sample=on_sample
        )

    async def rollout_step(self, record: CallRecord, spec: StepSpec) -> AsyncIterator[StepEvent]:
        """One rollout step (`StepRunner.run`); the record gets the step id and the summary."""
        if self.steps is None:
            raise FailedPrecondition("rollout steps are not enabled on this replica")
        record.request_id = spec.step_id
        async for event in self.steps.run(spec):
            if type(event) is GroupEnded:
                outcome = event.outcome.value
                record.step_groups[outcome] = record.step_groups.get(outcome, 0) + 1
                record.step_tokens += sum(item.new_tokens for item in event.samples)
                if event.outcome is Outcome.ACCEPTED:
                    record.version_lags.extend(event.version_lag)
            elif type(event) is Summary:
                record.result = event
            yield event

    # ----------------------------------------------------------------------------- control

    async def abort_all(self, record: CallRecord, caller_deadline: float | None = None) -> AbortResult:
        """Abort(all) (`Control.abort_all`), answered before `caller_deadline` (`time.monotonic()`)."""
        result = await self._control.abort_all(caller_deadline=caller_deadline)
        record.result = result
        return result

    async def abort_ids(self, record: CallRecord | None, request_ids: Sequence[str]) -> AbortResult:
        result = await self._control.abort_ids(request_ids)
        if record is not None:
            record.result = result
        return result

    async def abort_matching(
        self, record: CallRecord, *, session_id: str | None = None, group_index: int | None = None
    ) -> AbortResult:
        result = await self._control.abort_matching(session_id=session_id, group_index=group_index)
        record.result = result
        return result

    async def abort_mine(self, record: CallRecord) -> AbortResult:
        """Abort every generation of the caller on this replica (`Control.abort_mine`)."""
        result = await self._control.abort_mine()
        record.result = result
        return result

    async def abort_local(self, scope: AbortScope) -> AbortResult:
        """Abort matching generations of this replica only (a peer's forwarded abort)."""
        return await self._control.abort_local(scope)

    async def pause(self, record: CallRecord, mode: str) -> FleetResult:
        result = await self._control.pause(mode)
        record.result = result
        return result

    async def resume(self, record: CallRecord, weight_version: str | None) -> FleetResult:
        """Resume (`Control.resume`); a new `weight_version` first becomes the fleet's newest in
        the state store (FAILED_PRECONDITION, no engine touched, when it would go backwards), so a
        step on any replica measures its lags against it."""
        if weight_version and self.steps is not None:
            await self.steps.versions.advance(weight_version)  # the order staleness is measured in
        result = await self._control.resume(weight_version)
        record.result = result
        return result

    async def update_weights(self, record: CallRecord, update: WeightUpdate) -> WeightUpdateResult:
        """One fleet-wide weight update (`rollout/weights/`, which advances the fleet's version
        order in the store); this process's copy of the order is read again."""
        if self._weights is None:
            raise FailedPrecondition("weight updates are not available on this replica")
        result = await self._weights.update(update)
        if self.steps is not None:
            await self.steps.versions.refresh()
        return result

    async def plan_transfer(self, record: CallRecord, trainer_ranks: int) -> TransferPlan:
        """Distributed weight transfer: the group's rank plan (`rollout/weights/`)."""
        if self._weights is None:
            raise FailedPrecondition("weight transfers are not available on this replica")
        return await self._weights.plan_transfer(trainer_ranks)

    async def release_memory(self, record: CallRecord, release: MemoryRelease) -> FleetResult:
        """Colocated training: pause every engine and free its memory (`rollout/weights/`)."""
        if self._weights is None:
            raise FailedPrecondition("memory release is not available on this replica")
        result = await self._weights.release_memory(release)
        record.result = result
        return result

    async def resume_memory(self, record: CallRecord, tags: tuple[str, ...]) -> tuple[FleetResult, bool]:
        """Take the memory back; (result, whether generation resumed)."""
        if self._weights is None:
            raise FailedPrecondition("memory resume is not available on this replica")
        result, generating = await self._weights.resume_memory(tags)
        record.result = result
        return result, generating

    # ----------------------------------------------------------------------------- what the doors read

    async def server_info(self) -> ServerView:
        """Every engine (status and capability facts) and the admission counts, as values."""
        statuses = await self._control.engine_statuses()
        admission = self._rollout.admission
        return ServerView(
            engines=[_engine_view(status, self._rollout.pool.get(status.url)) for status in statuses],
            in_flight=admission.running,
            queued=admission.queued,
        )

    def engine_urls(self) -> list[str]:
        """The engines' addresses (what a door redacts from a non-admin's error message)."""
        return [engine.url for engine in self._rollout.pool.engines]

    def served_model(self) -> str:
        """The engines' served model name, for a response whose request named none (the fleet
        serves one model); empty before any capability check."""
        for engine in self._rollout.pool.engines:
            if engine.capabilities is not None and engine.capabilities.model:
                return engine.capabilities.model
        return ""

    async def models(self) -> list[ServedModel]:
        """The models a healthy engine serves (the fleet serves one model)."""
        engine = self._rollout.pool.pick()
        if engine is None:
            raise Unavailable("no healthy engine is available")
        try:
            return await engine.client.models()
        except EngineError as exc:
            raise Unavailable(f"engine {exc.url}: {exc.message}") from exc

    # ----------------------------------------------------------------------------- render, sessions

    async def render_chat(
        self,
        messages: list[tuple[str, list[Part]]],
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, object],
        session_id: str,
        model: str,
    ) -> Rendered:
        return await self._renderer.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            session_id=session_id,
            model=model,
        )

    async def render_request(
        self, request: ChatRenderRequest, *, session_id: str, field: str | None = None
    ) -> Rendered:
        """A conversation in the engines' chat shape, rendered on the session's engine: the same
        path as `render_chat` (`RenderService.render_request`), for the OpenAI door."""
        return await self._renderer.render_request(request, session_id=session_id, field=field)

    async def render_text(self, text: str, *, session_id: str, model: str) -> Rendered:
        return await self._renderer.render_text(text, session_id=session_id, model=model)

    async def session(self, session_id: str, caller: Caller, *, remove: bool = False) -> Session | None:
        """A recorded agent session of `caller` (admins read every session), None if missing;
        `remove` collects it. Read from the state store: any replica or worker answers."""
        if self.trajectories is None:
            return None
        return await self.trajectories.get(session_id, caller, remove=remove)

    @contextlib.asynccontextmanager
    async def open_session(self, session_id: str, owner: str) -> AsyncIterator[Session]:
        """`owner`'s session for one front-door request (rollout/sessions.py `Sessions.opened`)."""
        if self.trajectories is None:
            raise FailedPrecondition("agent sessions are not recorded on this replica")
        async with self.trajectories.opened(session_id, owner) as session:
            yield session

    async def record_turn(self, session: Session, turn: Turn, roles: list[str]) -> None:
        """Record a generated turn of `session` in the state store."""
        if self.trajectories is None:
            raise FailedPrecondition("agent sessions are not recorded on this replica")
        await self.trajectories.record(session, turn, roles)


def _engine_view(status: EngineStatus, engine: EngineHandle | None) -> EngineView:
    """One engine's status with the pool's capability facts (`known=False` when it left the pool
    between the two reads)."""
    view = EngineView(
        url=status.url,
        healthy=status.healthy,
        draining=status.draining,
        in_flight=status.in_flight,
        paused=status.paused,
        weight_version=status.weight_version,
        model=status.model,
        known=engine is not None,
    )
    if engine is None:
        return view
    caps = engine.capabilities
    capabilities = None
    if caps is not None:
        capabilities = CapabilityView(
            logprobs_mode=caps.logprobs_mode,
            model=caps.model,
            max_model_len=caps.max_model_len,
            scale_out=caps.scale_out,
            dev_mode=caps.dev_mode,
            is_moe=caps.is_moe,
            routed_experts=caps.routed_experts,
            warnings=tuple(caps.warnings),
        )
    return dataclasses.replace(
        view,
        kind=engine.client.kind,
        usable=engine.usable,
        problems=tuple(engine.problems),
        health_error="" if engine.healthy else engine.last_error or "health probe failed",
        capabilities=capabilities,
    )
