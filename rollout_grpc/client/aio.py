"""The asyncio client: `AsyncRolloutClient`."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast, overload

import grpc
import numpy as np

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.channel import (
    DEFAULT_CHANNEL_OPTIONS,
    DEFAULT_RETRY,
    RetryPolicy,
    batch_request_ids,
    build_request,
    channel_options,
    check_connections,
    check_target,
    connection_options,
    is_batch,
    resolve_timeout,
)
from rollout_grpc.client.credentials import ClientSecurity, PemLike
from rollout_grpc.client.errors import check_engine_errors, raising_rollout_errors
from rollout_grpc.client.samples import (
    BatchLike,
    OneSample,
    OptionsLike,
    ParamsLike,
    SampleLike,
    abort_request,
    pause_request,
    render_request,
    resume_request,
    update_weights_distributed_request,
    update_weights_request,
)
from rollout_grpc.client.step import GroupLike, StepProgressBar, step_request
from rollout_grpc.client.stubs import async_stub

if TYPE_CHECKING:
    from rollout_grpc._proto.rollout_pb2_grpc import RolloutServiceAsyncStub

__all__ = ["DEFAULT_CHANNEL_OPTIONS", "AsyncRolloutClient", "build_request"]

_NO_LOOP = (
    "AsyncRolloutClient calls must run inside an event loop (await them from a coroutine); "
    "use rollout_grpc.client.RolloutClient from blocking code"
)


class _Connections:
    """One event loop's channels and stubs, handed out round-robin."""

    def __init__(self, connections: list[tuple[grpc.aio.Channel, RolloutServiceAsyncStub]]) -> None:
        self.all = connections
        self._next = 0

    def next(self) -> tuple[grpc.aio.Channel, RolloutServiceAsyncStub]:
        found = self.all[self._next]
        self._next = (self._next + 1) % len(self.all)
        return found


class AsyncRolloutClient:
    """Calls a rollout service replica (or a load balancer in front of several).

    The client may be created anywhere, including at import time outside any event loop (what a
    slime custom-generate module does): the gRPC channel is opened lazily, one per event loop,
    because a grpc.aio channel belongs to the loop it was created in.
    """

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.aio.Channel | None = None,
        options: Sequence[tuple[str, Any]] = (),
        timeout: float | None = None,
        retry: RetryPolicy | None = DEFAULT_RETRY,
        tls: bool = False,
        root_certificates: PemLike | None = None,
        certificate_chain: PemLike | None = None,
        private_key: PemLike | None = None,
        token: str | None = None,
        server_name: str | None = None,
        connections: int = 1,
    ) -> None:
        """`timeout`: default deadline in seconds of generate and generate_stream calls that give
        none (None: no deadline; one call opts out with `timeout=math.inf`). `retry`: the gRPC
        retry policy for refused calls (RESOURCE_EXHAUSTED, UNAVAILABLE; honours the server's
        pushback); None disables it. A given `channel` is used as is, in its own event loop.

        TLS: `tls=True` (system roots) or `root_certificates` (PEM bytes or path); mTLS adds
        `certificate_chain` and `private_key`. `token` is sent as `authorization: Bearer` on
        every call of this client. `server_name` overrides the name checked in the server's
        certificate.

        `connections`: TCP connections (channels) opened to the target, calls spread over them
        round-robin. A replica started with `serve --workers N` serves each connection on one of
        its N worker processes (GetServerInfo().workers says N): one connection uses one of them,
        so a client that alone must load the whole replica opens N or more. The default, 1, is
        today's single connection: trainers usually run many client processes, each one
        connection, which the kernel spreads over the workers already.
        """
        self._connections = check_connections(connections)
        if channel is not None and connections != 1:
            raise ValueError("connections must be 1 with a given channel (it is used as is)")
        self._security = ClientSecurity(
            tls, root_certificates, certificate_chain, private_key, token, server_name
        )
        self._metadata = self._security.metadata()
        self._credentials = self._security.channel_credentials()
        self._target = check_target(target) if channel is None else target
        self._options = channel_options([*self._security.channel_options(), *options], retry)
        self._default_timeout = timeout
        self._given = (channel, async_stub(channel)) if channel is not None else None
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Connections] = (
            weakref.WeakKeyDictionary()
        )

    def _make_channel(self, index: int = 0) -> grpc.aio.Channel:
        """A new channel to the target (called once per event loop and connection)."""
        options = self._options if self._connections == 1 else connection_options(self._options, index)
        if self._credentials is not None:
            return grpc.aio.secure_channel(self._target, self._credentials, options=options)
        return grpc.aio.insecure_channel(self._target, options=options)

    def _connection(self) -> tuple[grpc.aio.Channel, RolloutServiceAsyncStub]:
        if self._given is not None:
            return self._given
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(_NO_LOOP) from None
        found = self._per_loop.get(loop)
        if found is None:
            channels = [self._make_channel(i) for i in range(self._connections)]
            found = self._per_loop[loop] = _Connections([(c, async_stub(c)) for c in channels])
        return found.next()

    @property
    def _stub(self) -> RolloutServiceAsyncStub:
        return self._connection()[1]

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close this event loop's channel (a given channel is closed too)."""
        if self._given is not None:
            await self._given[0].close()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(_NO_LOOP) from None
        found = self._per_loop.pop(loop, None)
        if found is not None:
            await asyncio.gather(*(channel.close() for channel, _ in found.all))

    @property
    def stub(self) -> RolloutServiceAsyncStub:
        """The generated stub, for calls this class does not wrap (they raise grpc's own errors)."""
        return self._stub

    async def generate_stream(
        self,
        sample: SampleLike,
        params: ParamsLike = None,
        options: OptionsLike = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Stream the Generate messages: deltas, then the final sample.

        Read it to its end; leaving it early (`break`, `aclose()`) cancels the call.
        """
        request = build_request(sample, params, options, request_id)
        call = self._stub.Generate(
            request, timeout=resolve_timeout(timeout, self._default_timeout), metadata=self._metadata
        )
        try:
            with raising_rollout_errors():
                async for message in call:
                    yield message
        finally:
            call.cancel()

    async def _generate_one(
        self,
        sample: SampleLike,
        params: ParamsLike,
        options: OptionsLike,
        timeout: float | None,
        request_id: str | None,
    ) -> pb.Sample:
        request = build_request(sample, params, options, request_id)
        request.options.final_only = True
        deadline = resolve_timeout(timeout, self._default_timeout)
        final: pb.Sample | None = None
        # To the stream's end, as RolloutClient does: a call dropped before its trailing status
        # arrived is cancelled when grpc collects it (`grpc.aio.Call.__del__`), a CANCELLED on the
        # server for a call that succeeded.
        with raising_rollout_errors():
            async for message in self._stub.Generate(request, timeout=deadline, metadata=self._metadata):
                if message.HasField("sample"):
                    final = message.sample
        if final is None:
            raise RuntimeError("the Generate stream ended without a sample")
        return final

    @overload
    async def generate(
        self,
        sample: BatchLike,
        params: ParamsLike = ...,
        options: OptionsLike = ...,
        *,
        timeout: float | None = ...,
        request_ids: Sequence[str] | None = ...,
    ) -> list[pb.Sample]: ...

    @overload
    async def generate(
        self,
        sample: OneSample,
        params: ParamsLike = ...,
        options: OptionsLike = ...,
        *,
        timeout: float | None = ...,
        request_id: str | None = ...,
    ) -> pb.Sample: ...

    @overload
    async def generate(
        self,
        sample: np.ndarray,
        params: ParamsLike = ...,
        options: OptionsLike = ...,
        *,
        timeout: float | None = ...,
        request_id: str | None = ...,
        request_ids: Sequence[str] | None = ...,
    ) -> pb.Sample | list[pb.Sample]: ...

    async def generate(
        self,
        sample: SampleLike | BatchLike,
        params: ParamsLike = None,
        options: OptionsLike = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> pb.Sample | list[pb.Sample]:
        """Generate one sample, or a batch of samples concurrently (results in input order).

        One sample: a `pb.Sample`, a dict of Sample fields, or prompt token ids (a list, tuple or
        1-D integer numpy array; numpy integers are fine). A batch: a list or tuple of those
        (`[ids_a, ids_b]`, `(s1, s2)`); `[]` returns `[]`. `request_ids` names the batch's calls
        (one per sample), so `abort(request_ids=[...])` can stop one of them; without it each
        call gets a fresh id.
        """
        if is_batch(sample):
            batch = cast("BatchLike", sample)  # a 2-D array too: it iterates as its rows
            ids = batch_request_ids(len(batch), request_ids)
            return list(
                await asyncio.gather(
                    *(
                        self._generate_one(s, params, options, timeout, rid)
                        for s, rid in zip(batch, ids, strict=True)
                    )
                )
            )
        return await self._generate_one(cast("SampleLike", sample), params, options, timeout, request_id)

    async def rollout_step(
        self,
        groups: Sequence[GroupLike],
        *,
        n_samples_per_prompt: int,
        progress_bar: bool = False,
        timeout: float | None = None,
        **policies: Any,
    ) -> AsyncGenerator[pb.RolloutStepResponse, None]:
        """Run one rollout step; yield its events (`group` results, `progress`, `sample` with
        `stream_samples`, last the `summary`). `policies` are `step_request`'s keywords
        (step_id, target_groups, max_groups_in_flight, params, options, reward, filter, leftovers,
        continue_buffered, max_staleness, on_stale, stream_samples, over_sampling, over_sampling_batch_size,
        consumed_weight_version, max_head_offpolicyness, episode). Leaving early cancels the call;
        the server then aborts the step's groups into this caller's buffer (nothing is lost).
        """
        request = step_request(groups, n_samples_per_prompt=n_samples_per_prompt, **policies)
        bar = StepProgressBar(request.target_groups or len(request.groups)) if progress_bar else None
        call = self._stub.RolloutStep(
            request, timeout=resolve_timeout(timeout, self._default_timeout), metadata=self._metadata
        )
        try:
            with raising_rollout_errors():
                async for message in call:
                    if bar is not None:
                        bar.update(message)
                    yield message
        finally:
            call.cancel()
            if bar is not None:
                bar.close()

    async def abort(
        self,
        *,
        all: bool = False,
        request_ids: Sequence[str] = (),
        session_id: str | None = None,
        group_index: int | None = None,
        mine: bool = False,
        timeout: float | None = 30.0,
        raise_on_engine_errors: bool = True,
    ) -> pb.AbortResponse:
        """Abort all in-flight generations, some request ids, a session or a prompt group; `mine`:
        every generation of this caller (any role), including one still on the wire.

        Raises `EngineErrors` when engines failed (`raise_on_engine_errors=False`: return them).
        """
        request = abort_request(
            all=all, request_ids=request_ids, session_id=session_id, group_index=group_index, mine=mine
        )
        with raising_rollout_errors():
            response = await self._stub.Abort(request, timeout=timeout, metadata=self._metadata)
        return check_engine_errors("Abort", response, raise_on_engine_errors)

    async def pause(
        self, mode: str = "keep", *, timeout: float | None = None, raise_on_engine_errors: bool = True
    ) -> pb.PauseResponse:
        """Pause every engine: "abort", "wait" or "keep" (`EngineErrors` when some failed)."""
        with raising_rollout_errors():
            response = await self._stub.Pause(pause_request(mode), timeout=timeout, metadata=self._metadata)
        return check_engine_errors("Pause", response, raise_on_engine_errors)

    async def resume(
        self,
        weight_version: str | None = None,
        *,
        timeout: float | None = 60.0,
        raise_on_engine_errors: bool = True,
    ) -> pb.ResumeResponse:
        """Resume every engine, optionally labelling its weights with `weight_version` first.

        Raises `EngineErrors` when some engines failed (`raise_on_engine_errors=False`: return them).
        """
        request = resume_request(weight_version)
        with raising_rollout_errors():
            response = await self._stub.Resume(request, timeout=timeout, metadata=self._metadata)
        return check_engine_errors("Resume", response, raise_on_engine_errors)

    async def update_weights(
        self,
        checkpoint: str,
        weight_version: str,
        *,
        pause_mode: str = "keep",
        all_at_once: bool = False,
        timeout: float | None = None,
    ) -> pb.UpdateWeightsResponse:
        """Move every engine to the checkpoint directory `checkpoint` (shared storage under the
        replica's `--weights-path-prefix`), labelled `weight_version`: one serialised, fleet-wide
        pause (`pause_mode`, as `pause`) -> load -> label -> resume (docs/engines.md "Weight
        updates"). Raises `RolloutError` subclasses: unavailable when some engine did not take it
        (named in the message; repeating the same call loads on those engines), failed precondition
        for a version that goes backwards or another update in progress. No timeout by default: a
        load takes as long as the checkpoint does."""
        request = update_weights_request(
            checkpoint, weight_version, pause_mode=pause_mode, all_at_once=all_at_once
        )
        with raising_rollout_errors():
            response: pb.UpdateWeightsResponse = await self._stub.UpdateWeights(
                request, timeout=timeout, metadata=self._metadata
            )
        return response

    async def plan_weight_transfer(
        self, trainer_ranks: int = 1, *, timeout: float | None = 60.0
    ) -> pb.PlanWeightTransferResponse:
        """Distributed transfer, step 1: the group's `world_size` and every engine's rank offset
        (the trainer holds ranks 0..trainer_ranks-1; rank 0 broadcasts). Create the trainer's side
        of the group with that world size, then call `update_weights_distributed` while
        broadcasting (docs/engines.md "Weight updates"; unverified without GPUs)."""
        with raising_rollout_errors():
            response: pb.PlanWeightTransferResponse = await self._stub.PlanWeightTransfer(
                pb.PlanWeightTransferRequest(trainer_ranks=trainer_ranks),
                timeout=timeout,
                metadata=self._metadata,
            )
        return response

    async def update_weights_distributed(
        self,
        weight_version: str,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        tensors: Sequence[tuple[str, str, Sequence[int]]],
        group_name: str = "weight_update_group",
        pause_mode: str = "keep",
        timeout: float | None = None,
    ) -> pb.UpdateWeightsResponse:
        """Distributed transfer, step 2: pause, let every engine receive `tensors` ((name, torch
        dtype, shape), in broadcast order) from the trainer's broadcast in the planned group (joining
        it the first time), label, resume. The trainer broadcasts while this call runs."""
        request = update_weights_distributed_request(
            weight_version,
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            tensors=tensors,
            group_name=group_name,
            pause_mode=pause_mode,
        )
        with raising_rollout_errors():
            response: pb.UpdateWeightsResponse = await self._stub.UpdateWeights(
                request, timeout=timeout, metadata=self._metadata
            )
        return response

    async def release_memory(
        self,
        *,
        level: int | None = None,
        tags: Sequence[str] = (),
        timeout: float | None = 60.0,
        raise_on_engine_errors: bool = True,
    ) -> pb.ReleaseMemoryResponse:
        """Colocated training: pause every engine (ABORT) and free its accelerator memory — vLLM's
        sleep `level` (default 1), SGLang's `tags` ("weights", "kv_cache"; none: all). `EngineErrors`
        when some engines failed (`raise_on_engine_errors=False`: return them)."""
        request = pb.ReleaseMemoryRequest(tags=list(tags))
        if level is not None:
            request.level = level
        with raising_rollout_errors():
            response: pb.ReleaseMemoryResponse = await self._stub.ReleaseMemory(
                request, timeout=timeout, metadata=self._metadata
            )
        return check_engine_errors("ReleaseMemory", response, raise_on_engine_errors)

    async def resume_memory(
        self, tags: Sequence[str] = (), *, timeout: float | None = 60.0, raise_on_engine_errors: bool = True
    ) -> pb.ResumeMemoryResponse:
        """Take the memory `tags` name back on every engine (none: all); the engines generate again
        once every region is back (`response.generating`)."""
        request = pb.ResumeMemoryRequest(tags=list(tags))
        with raising_rollout_errors():
            response: pb.ResumeMemoryResponse = await self._stub.ResumeMemory(
                request, timeout=timeout, metadata=self._metadata
            )
        return check_engine_errors("ResumeMemory", response, raise_on_engine_errors)

    async def get_server_info(self, *, timeout: float | None = 30.0) -> pb.GetServerInfoResponse:
        """GetServerInfo: the replica's view of its engines. Named after the RPC as every other
        method is (`get_trajectory` calls GetTrajectory); `server_info` is the same method."""
        with raising_rollout_errors():
            return await self._stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=timeout, metadata=self._metadata
            )

    #: The same method as `get_server_info` (its earlier name; kept, not deprecated).
    server_info = get_server_info

    async def render(
        self,
        messages: Sequence[Mapping[str, Any]] | None = None,
        *,
        text: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        session_id: str = "",
        timeout: float | None = 60.0,
    ) -> pb.RenderResponse:
        """Render chat messages (text and image bytes) or a plain text into token ids and features."""
        request = render_request(
            messages,
            text=text,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            session_id=session_id,
        )
        with raising_rollout_errors():
            return await self._stub.Render(request, timeout=timeout, metadata=self._metadata)

    async def get_trajectory(
        self, session_id: str, *, remove: bool = False, timeout: float | None = 30.0
    ) -> pb.GetTrajectoryResponse:
        """A front-door session as training samples (ask the replica whose front door served it)."""
        request = pb.GetTrajectoryRequest(session_id=session_id, remove=remove)
        with raising_rollout_errors():
            return await self._stub.GetTrajectory(request, timeout=timeout, metadata=self._metadata)
