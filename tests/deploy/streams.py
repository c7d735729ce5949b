"""Streaming Generate calls run in the background, recording every delta, for the deploy tests.

A `Stream` keeps what the caller actually received (token ids and logprobs of every delta, in
order), so a test can check the promise of the contract: the final sample's new tokens are exactly
the streamed ones, also when the stream was aborted or the replica shut down.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb

#: A short prompt of ordinary ids (valid in the simulator's 2048-token vocabulary).
PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301]
SERVICE = "rollout.v1.RolloutService"
#: Flush every token at once: the stream shows exactly what was generated before an abort.
EVERY_TOKEN = {"stream_batch_tokens": 1, "stream_batch_interval_ms": 0}
#: Bound on every wait for a stream event (never reached when things work).
WAIT_S = 60.0


def params(max_new_tokens: int) -> dict[str, object]:
    """Sampling parameters that run exactly `max_new_tokens` unless aborted (EOS ignored)."""
    return {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


@dataclass
class Stream:
    """A Generate stream consumed by a background task; `first` is set at its first token."""

    request_id: str
    max_new_tokens: int
    first: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    deltas: int = 0
    task: asyncio.Task[pb.Sample] | None = None

    async def final(self) -> pb.Sample:
        """The final sample (raises what the call raised)."""
        assert self.task is not None
        return await asyncio.wait_for(self.task, WAIT_S)


def start_stream(client: AsyncRolloutClient, request_id: str, max_new_tokens: int) -> Stream:
    """Start a streaming Generate (one token per delta) in the background."""
    stream = Stream(request_id, max_new_tokens)

    async def run() -> pb.Sample:
        final: pb.Sample | None = None
        async for message in client.generate_stream(
            make_sample(PROMPT), params(max_new_tokens), EVERY_TOKEN, request_id=request_id, timeout=WAIT_S
        ):
            assert final is None, "the final sample must be the last message"
            if message.HasField("delta"):
                assert message.delta.offset == len(stream.tokens), "deltas must be contiguous"
                stream.tokens.extend(message.delta.token_ids)
                stream.logprobs.extend(message.delta.logprobs)
                stream.deltas += 1
                if message.delta.token_ids:
                    stream.first.set()
            else:
                final = message.sample
        assert final is not None, "the stream ended without a final sample"
        return final

    stream.task = asyncio.create_task(run(), name=f"stream-{request_id}")
    return stream


async def started(*streams: Stream) -> None:
    """Wait until every stream has received a token (they are then in flight on an engine)."""
    await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), WAIT_S)


def assert_lossless(stream: Stream, sample: pb.Sample) -> None:
    """What the caller received as deltas is exactly the final sample's new response."""
    assert list(sample.tokens[: len(PROMPT)]) == PROMPT
    assert list(sample.tokens[len(PROMPT) :]) == stream.tokens
    assert list(sample.rollout_log_probs) == stream.logprobs
    assert sample.response_length == len(stream.tokens) == len(sample.loss_mask)


def assert_aborted(stream: Stream, sample: pb.Sample) -> None:
    """Ended early by an abort, keeping every token it streamed."""
    assert sample.status == pb.SAMPLE_STATUS_ABORTED, pb.SampleStatus.Name(sample.status)
    assert sample.finish_reason == pb.FINISH_REASON_ABORT
    assert 1 <= sample.response_length < stream.max_new_tokens
    assert_lossless(stream, sample)


def assert_finished(stream: Stream, sample: pb.Sample) -> None:
    """Ran to its length budget, every token streamed."""
    assert sample.status == pb.SAMPLE_STATUS_TRUNCATED, pb.SampleStatus.Name(sample.status)
    assert sample.response_length == stream.max_new_tokens
    assert_lossless(stream, sample)


async def health_status(target: str, service: str) -> int:
    """`grpc.health.v1.Health/Check` of `service` at `target`."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return int(response.status)
