"""The blocking client: `RolloutClient`, the same API as `AsyncRolloutClient` without `await`."""

from __future__ import annotations

import itertools
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast, overload

import grpc
import numpy as np

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.channel import (
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
from rollout_grpc.client.stubs import sync_stub

if TYPE_CHECKING:
    from rollout_grpc._proto.rollout_pb2_grpc import RolloutServiceStub


class RolloutClient:
    """Blocking calls to a rollout service replica; lists of samples run on a thread pool."""

    def __init__(
        self,
        target: str,
        *,
        max_workers: int = 64,
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
        """`timeout` and `retry` as in AsyncRolloutClient: a default deadline for generate calls,
        and gRPC retries of refused calls honouring the server's pushback (None disables); TLS,
        mTLS and token options as in `AsyncRolloutClient`; `connections` too (TCP connections
        that calls are spread over round-robin, for a `serve --workers N` replica)."""
        target = check_target(target)
        security = ClientSecurity(tls, root_certificates, certificate_chain, private_key, token, server_name)
        self._metadata = security.metadata()
        options = channel_options([*security.channel_options(), *options], retry)
        credentials = security.channel_credentials()
        count = check_connections(connections)
        self._channels: list[grpc.Channel] = []
        for index in range(count):
            these = options if count == 1 else connection_options(options, index)
            if credentials is not None:
                self._channels.append(grpc.secure_channel(target, credentials, options=these))
            else:
                self._channels.append(grpc.insecure_channel(target, options=these))
        self._channel = self._channels[0]
        self._stubs = [sync_stub(channel) for channel in self._channels]
        self._turn = itertools.count()
        self._max_workers = max_workers
        self._default_timeout = timeout

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _stub(self) -> RolloutServiceStub:
        """The next connection's stub (round-robin; `itertools.count` is thread-safe in CPython)."""
        return self._stubs[next(self._turn) % len(self._stubs)]

    def close(self) -> None:
        """Close the channels."""
        for channel in self._channels:
            channel.close()

    def generate_stream(
        self,
        sample: SampleLike,
        params: ParamsLike = None,
        options: OptionsLike = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Generator[pb.GenerateResponse, None, None]:
        """Stream the Generate messages: deltas, then the final sample.

        Read it to its end; leaving it early (`break`, `close()`) cancels the call.
        """
        request = build_request(sample, params, options, request_id)
        call = self._stub.Generate(
            request, timeout=resolve_timeout(timeout, self._default_timeout), metadata=self._metadata
        )
        try:
            with raising_rollout_errors():
                yield from call
        finally:
            call.cancel()

    def _generate_one(
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
        # Read on past the sample to the stream's end (the trailing OK status): a call dropped
        # before its status arrived is cancelled when grpc collects it (`_Rendezvous.__del__`), and
        # the server would record this successful call as CANCELLED.
        with raising_rollout_errors():
            for message in self._stub.Generate(request, timeout=deadline, metadata=self._metadata):
                if message.HasField("sample"):
                    final = message.sample
        if final is None:
            raise RuntimeError("the Generate stream ended without a sample")
        return final

    @overload
    def generate(
        self,
        sample: BatchLike,
        params: ParamsLike = ...,
        options: OptionsLike = ...,
        *,
        timeout: float | None = ...,
        request_ids: Sequence[str] | None = ...,
    ) -> list[pb.Sample]: ...

    @overload
    def generate(
        self,
        sample: OneSample,
        params: ParamsLike = ...,
        options: OptionsLike = ...,
        *,
        timeout: float | None = ...,
        request_id: str | None = ...,
    ) -> pb.Sample: ...

    @overload
    def generate(
        self,
        sample: np.ndarray,
        params: ParamsLike = ...,
        options: OptionsLike = ...,
        *,
        timeout: float | None = ...,
        request_id: str | None = ...,
        request_ids: Sequence[str] | None = ...,
    ) -> pb.Sample | list[pb.Sample]: ...

    def generate(
        self,
        sample: SampleLike | BatchLike,
        params: ParamsLike = None,
        options: OptionsLike = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> pb.Sample | list[pb.Sample]:
        """Generate one sample (-> Sample), or a batch concurrently (-> list, in input order).

        The same inputs as AsyncRolloutClient.generate: tuples, numpy ids, `[]` -> `[]`, and
        `request_ids` to name a batch's calls so one can be aborted from another thread. Typed
        per input: a batch gives `list[pb.Sample]`, one sample `pb.Sample`; a numpy array gives
        either (1-D: one, 2-D: a batch; its rank is not in its static type).
        """
        if is_batch(sample):
            batch = cast("BatchLike", sample)  # a 2-D array too: it iterates as its rows
            if not len(batch):
                return []
            ids = batch_request_ids(len(batch), request_ids)
            with ThreadPoolExecutor(max_workers=min(self._max_workers, len(batch))) as pool:
                futures = [
                    pool.submit(self._generate_one, s, params, options, timeout, rid)
                    for s, rid in zip(batch, ids, strict=True)
                ]
                return [f.result() for f in futures]
        return self._generate_one(cast("SampleLike", sample), params, options, timeout, request_id)

    def rollout_step(
        self,
        groups: Sequence[GroupLike],
        *,
        n_samples_per_prompt: int,
        progress_bar: bool = False,
        timeout: float | None = None,
        **policies: Any,
    ) -> Generator[pb.RolloutStepResponse, None, None]:
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
                for message in call:
                    if bar is not None:
                        bar.update(message)
                    yield message
        finally:
            call.cancel()
            if bar is not None:
                bar.close()

    def abort(
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
            response: pb.AbortResponse = self._stub.Abort(request, timeout=timeout, metadata=self._metadata)
        return check_engine_errors("Abort", response, raise_on_engine_errors)

    def pause(
        self, mode: str = "keep", *, timeout: float | None = None, raise_on_engine_errors: bool = True
    ) -> pb.PauseResponse:
        """Pause every engine: "abort", "wait" or "keep" (`EngineErrors` when some failed)."""
        with raising_rollout_errors():
            response: pb.PauseResponse = self._stub.Pause(
                pause_request(mode), timeout=timeout, metadata=self._metadata
            )
        return check_engine_errors("Pause", response, raise_on_engine_errors)

    def resume(
        self,
        weight_version: str | None = None,
        *,
        timeout: float | None = 60.0,
        raise_on_engine_errors: bool = True,
    ) -> pb.ResumeResponse:
        """Resume every engine, optionally labelling its weights first (`EngineErrors` when some
        failed; `raise_on_engine_errors=False` returns them)."""
        request = resume_request(weight_version)
        with raising_rollout_errors():
            response: pb.ResumeResponse = self._stub.Resume(request, timeout=timeout, metadata=self._metadata)
        return check_engine_errors("Resume", response, raise_on_engine_errors)

    def update_weights(
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
            response: pb.UpdateWeightsResponse = self._stub.UpdateWeights(
                request, timeout=timeout, metadata=self._metadata
            )
        return response

    def plan_weight_transfer(
        self, trainer_ranks: int = 1, *, timeout: float | None = 60.0
    ) -> pb.PlanWeightTransferResponse:
        """Distributed transfer, step 1: the group's `world_size` and every engine's rank offset
        (the trainer holds ranks 0..trainer_ranks-1; rank 0 broadcasts). Create the trainer's side
        of the group with that world size, then call `update_weights_distributed` while
        broadcasting (docs/engines.md "Weight updates"; unverified without GPUs)."""
        with raising_rollout_errors():
            response: pb.PlanWeightTransferResponse = self._stub.PlanWeightTransfer(
                pb.PlanWeightTransferRequest(trainer_ranks=trainer_ranks),
                timeout=timeout,
                metadata=self._metadata,
            )
        return response

    def update_weights_distributed(
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
            response: pb.UpdateWeightsResponse = self._stub.UpdateWeights(
                request, timeout=timeout, metadata=self._metadata
            )
        return response

    def release_memory(
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
            response: pb.ReleaseMemoryResponse = self._stub.ReleaseMemory(
                request, timeout=timeout, metadata=self._metadata
            )
        return check_engine_errors("ReleaseMemory", response, raise_on_engine_errors)

    def resume_memory(
        self, tags: Sequence[str] = (), *, timeout: float | None = 60.0, raise_on_engine_errors: bool = True
    ) -> pb.ResumeMemoryResponse:
        """Take the memory `tags` name back on every engine (none: all); the engines generate again
        once every region is back (`response.generating`)."""
        request = pb.ResumeMemoryRequest(tags=list(tags))
        with raising_rollout_errors():
            response: pb.ResumeMemoryResponse = self._stub.ResumeMemory(
                request, timeout=timeout, metadata=self._metadata
            )
        return check_engine_errors("ResumeMemory", response, raise_on_engine_errors)

    def get_server_info(self, *, timeout: float | None = 30.0) -> pb.GetServerInfoResponse:
        """GetServerInfo: the replica's view of its engines. Named after the RPC as every other
        method is (`get_trajectory` calls GetTrajectory); `server_info` is the same method."""
        with raising_rollout_errors():
            response: pb.GetServerInfoResponse = self._stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=timeout, metadata=self._metadata
            )
        return response

    #: The same method as `get_server_info` (its earlier name; kept, not deprecated).
    server_info = get_server_info

    def render(
        self,
        messages: Sequence[Mapping[str, Any]] | None = None,
        *,
        text: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        session_id: str = "",
        timeout: float | None = 60.0,
    ) -> pb.RenderResponse:
        """Render chat messages or a plain text into token ids and features."""
        request = render_request(
            messages,
            text=text,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            session_id=session_id,
        )
        with raising_rollout_errors():
            response: pb.RenderResponse = self._stub.Render(request, timeout=timeout, metadata=self._metadata)
        return response

    def get_trajectory(
        self, session_id: str, *, remove: bool = False, timeout: float | None = 30.0
    ) -> pb.GetTrajectoryResponse:
        """A front-door session as training samples (ask the replica whose front door served it)."""
        request = pb.GetTrajectoryRequest(session_id=session_id, remove=remove)
        with raising_rollout_errors():
            return self._stub.GetTrajectory(request, timeout=timeout, metadata=self._metadata)
