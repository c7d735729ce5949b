"""Helpers for tests that drive the service over gRPC: a prompt, streams, lossless checks, field errors."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.server.domain.identity import ANONYMOUS
from rollout_grpc.server.engines.vllm.adapter import engine_request_id
from tests.harness import Harness

#: A ChatML prompt of ordinary ids from real tiny-model recordings (valid in a 2048-token vocabulary).
PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301, 835, 38, 2, 206, 1, 72, 345, 80, 1653, 206]


async def collect(
    h: Harness,
    sample: pb.Sample,
    params: dict[str, object],
    options: dict[str, object] | None = None,
    request_id: str | None = None,
) -> tuple[list[pb.TokenDelta], pb.Sample]:
    """Run one streaming Generate; return the deltas and the final sample (checking it is last)."""
    deltas: list[pb.TokenDelta] = []
    final: pb.Sample | None = None
    async for message in h.client.generate_stream(
        sample, params, options, request_id=request_id, timeout=120
    ):
        assert final is None, "the final sample must be the last message"
        if message.HasField("delta"):
            deltas.append(message.delta)
        else:
            final = message.sample
    assert final is not None
    return deltas, final


def engine_id(
    server: RolloutServer, request_id: str, owner: str = ANONYMOUS.identity, attempt: int = 0
) -> str:
    """The id a (simulated) vLLM engine tracks call `attempt` of `owner`'s `request_id` on `server`
    by: engine ids are unique per replica and owner (rollout/call_ids.py), never the request id."""
    return engine_request_id(server.rollout.call_ids.call_id(owner, request_id, attempt))


def field_violation(err: grpc.aio.AioRpcError) -> str:
    """The BadRequest field named by an INVALID_ARGUMENT error."""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    status = rpc_status.from_call(err)
    assert status is not None
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return str(bad.field_violations[0].field)
    raise AssertionError("no BadRequest detail")


#: Long enough that generations are still running when the test acts (sim: 5 ms per token).
#: Simulated engines slow enough that a test can act while a stream runs.
SLOW_SIM: dict[str, object] = {"token_delay_s": 0.005}
LONG: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 3000, "ignore_eos": True}
STREAM_EVERY_TOKEN = {"stream_batch_tokens": 1, "stream_batch_interval_ms": 0}


@dataclass
class Stream:
    """A running Generate whose deltas are recorded; `first` is set at the first token."""

    task: asyncio.Task[pb.Sample]
    first: asyncio.Event
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def start_stream(
    client: AsyncRolloutClient,
    request_id: str,
    params: dict[str, object] = LONG,
    sample: pb.Sample | None = None,
    options: dict[str, object] | None = None,
) -> Stream:
    """Start a streaming Generate in the background."""
    first = asyncio.Event()
    stream = Stream(task=None, first=first)  # type: ignore[arg-type]

    async def run() -> pb.Sample:
        final = None
        async for message in client.generate_stream(
            sample or make_sample(PROMPT),
            params,
            {**STREAM_EVERY_TOKEN, **(options or {})},
            request_id=request_id,
            timeout=300,
        ):
            if message.HasField("delta"):
                stream.tokens.extend(message.delta.token_ids)
                stream.logprobs.extend(message.delta.logprobs)
                if message.delta.token_ids:
                    first.set()
            else:
                final = message.sample
        assert final is not None
        return final

    stream.task = asyncio.create_task(run())
    return stream


async def started(*streams: Stream) -> None:
    """Wait until every stream has received at least one token."""
    await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 120)


def assert_lossless(stream: Stream, sample: pb.Sample, prompt_len: int = len(PROMPT)) -> None:
    """What was streamed is exactly what the final sample holds."""
    assert list(sample.tokens[prompt_len:]) == stream.tokens
    assert list(sample.rollout_log_probs) == stream.logprobs
    assert len(sample.loss_mask) == sample.response_length == len(stream.tokens)
