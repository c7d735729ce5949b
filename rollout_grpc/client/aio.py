"""The asyncio client: `AsyncRolloutClient`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, overload

import grpc

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.client.errors import check_engine_errors
from rollout_grpc.client.samples import (
    OptionsLike,
    ParamsLike,
    SampleLike,
    abort_request,
    pause_request,
    render_request,
    resume_request,
    to_options,
    to_params,
    to_sample,
)

#: Receive limit large enough for a long sample's routed experts in one message.
DEFAULT_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


def build_request(
    sample: SampleLike, params: ParamsLike, options: OptionsLike, request_id: str | None
) -> pb.GenerateRequest:
    """A GenerateRequest with a request id (generated when not given, so Abort can target it)."""
    return pb.GenerateRequest(
        sample=to_sample(sample),
        sampling_params=to_params(params),
        options=to_options(options),
        request_id=request_id or uuid.uuid4().hex,
    )


class AsyncRolloutClient:
    """Calls a rollout service replica (or a load balancer in front of several)."""

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.aio.Channel | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._channel = channel or grpc.aio.insecure_channel(
            target, options=[*DEFAULT_CHANNEL_OPTIONS, *options]
        )
        self._stub = pb_grpc.RolloutServiceStub(self._channel)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    @property
    def stub(self) -> pb_grpc.RolloutServiceStub:
        """The generated stub, for calls this class does not wrap."""
        return self._stub

    async def generate_stream(
        self,
        sample: SampleLike,
        params: ParamsLike = None,
        options: OptionsLike = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the Generate messages: deltas, then the final sample."""
        request = build_request(sample, params, options, request_id)
        call = self._stub.Generate(request, timeout=timeout)
        try:
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
        async for message in self._stub.Generate(request, timeout=timeout):
            if message.HasField("sample"):
                return message.sample
        raise RuntimeError("the Generate stream ended without a sample")

    @overload
    async def generate(
        self,
        sample: SampleLike,
        params: ParamsLike = ...,
        options: OptionsLike = ...,
        *,
        timeout: float | None = ...,
        request_id: str | None = ...,
    ) -> pb.Sample: ...

    @overload
    async def generate(
        self,
        sample: list[pb.Sample] | list[SampleLike],
        params: ParamsLike = ...,
        options: OptionsLike = ...,
        *,
        timeout: float | None = ...,
        request_id: str | None = ...,
    ) -> list[pb.Sample]: ...

    async def generate(
        self,
        sample: SampleLike | list[pb.Sample] | list[SampleLike],
        params: ParamsLike = None,
        options: OptionsLike = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> pb.Sample | list[pb.Sample]:
        """Generate one sample, or a list of samples concurrently (results in input order).

        A list of plain token ids counts as one sample; pass `[ids_a, ids_b]` for two.
        """
        if isinstance(sample, list) and sample and not isinstance(sample[0], int):
            return list(
                await asyncio.gather(*(self._generate_one(s, params, options, timeout, None) for s in sample))
            )
        return await self._generate_one(sample, params, options, timeout, request_id)  # type: ignore[arg-type]

    async def abort(
        self,
        *,
        all: bool = False,
        request_ids: Sequence[str] = (),
        session_id: str | None = None,
        group_index: int | None = None,
        timeout: float | None = 30.0,
        raise_on_engine_errors: bool = True,
    ) -> pb.AbortResponse:
        """Abort all in-flight generations, some request ids, a session or a prompt group.

        Raises `EngineErrors` when engines failed (`raise_on_engine_errors=False`: return them).
        """
        request = abort_request(
            all=all, request_ids=request_ids, session_id=session_id, group_index=group_index
        )
        response = await self._stub.Abort(request, timeout=timeout)
        return check_engine_errors("Abort", response, raise_on_engine_errors)

    async def pause(
        self, mode: str = "keep", *, timeout: float | None = None, raise_on_engine_errors: bool = True
    ) -> pb.PauseResponse:
        """Pause every engine: "abort", "wait" or "keep" (`EngineErrors` when some failed)."""
        response = await self._stub.Pause(pause_request(mode), timeout=timeout)
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
        response = await self._stub.Resume(request, timeout=timeout)
        return check_engine_errors("Resume", response, raise_on_engine_errors)

    async def server_info(self, *, timeout: float | None = 30.0) -> pb.GetServerInfoResponse:
        """The replica's view of its engines."""
        return await self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)

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
        return await self._stub.Render(request, timeout=timeout)
