"""The blocking client: `RolloutClient`, the same API as `AsyncRolloutClient` without `await`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.client.aio import DEFAULT_CHANNEL_OPTIONS, build_request
from rollout_grpc.client.errors import check_engine_errors
from rollout_grpc.client.samples import (
    OptionsLike,
    ParamsLike,
    SampleLike,
    abort_request,
    pause_request,
    render_request,
    resume_request,
)


class RolloutClient:
    """Blocking calls to a rollout service replica; lists of samples run on a thread pool."""

    def __init__(
        self, target: str, *, max_workers: int = 64, options: Sequence[tuple[str, Any]] = ()
    ) -> None:
        self._channel = grpc.insecure_channel(target, options=[*DEFAULT_CHANNEL_OPTIONS, *options])
        self._stub = pb_grpc.RolloutServiceStub(self._channel)
        self._max_workers = max_workers

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def generate_stream(
        self,
        sample: SampleLike,
        params: ParamsLike = None,
        options: OptionsLike = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the Generate messages: deltas, then the final sample."""
        call = self._stub.Generate(build_request(sample, params, options, request_id), timeout=timeout)
        try:
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
        for message in self._stub.Generate(request, timeout=timeout):
            if message.HasField("sample"):
                return message.sample
        raise RuntimeError("the Generate stream ended without a sample")

    def generate(
        self,
        sample: SampleLike | list[SampleLike],
        params: ParamsLike = None,
        options: OptionsLike = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> pb.Sample | list[pb.Sample]:
        """Generate one sample, or a list concurrently (results in input order)."""
        if isinstance(sample, list) and sample and not isinstance(sample[0], int):
            with ThreadPoolExecutor(max_workers=min(self._max_workers, len(sample))) as pool:
                futures = [pool.submit(self._generate_one, s, params, options, timeout, None) for s in sample]
                return [f.result() for f in futures]
        return self._generate_one(sample, params, options, timeout, request_id)  # type: ignore[arg-type]

    def abort(
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
        response: pb.AbortResponse = self._stub.Abort(request, timeout=timeout)
        return check_engine_errors("Abort", response, raise_on_engine_errors)

    def pause(
        self, mode: str = "keep", *, timeout: float | None = None, raise_on_engine_errors: bool = True
    ) -> pb.PauseResponse:
        """Pause every engine: "abort", "wait" or "keep" (`EngineErrors` when some failed)."""
        response: pb.PauseResponse = self._stub.Pause(pause_request(mode), timeout=timeout)
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
        response: pb.ResumeResponse = self._stub.Resume(request, timeout=timeout)
        return check_engine_errors("Resume", response, raise_on_engine_errors)

    def server_info(self, *, timeout: float | None = 30.0) -> pb.GetServerInfoResponse:
        """The replica's view of its engines."""
        response: pb.GetServerInfoResponse = self._stub.GetServerInfo(
            pb.GetServerInfoRequest(), timeout=timeout
        )
        return response

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
        response: pb.RenderResponse = self._stub.Render(request, timeout=timeout)
        return response
