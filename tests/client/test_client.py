"""The Python clients against a live replica: inputs they accept, batches, deadlines, retries, loops."""

from __future__ import annotations

import asyncio
import math
import os
import time

import grpc
import numpy as np
import pytest

import rollout_grpc
from rollout_grpc.client import (
    AsyncRolloutClient,
    RetryPolicy,
    RolloutClient,
    make_sample,
    new_request_id,
    pb,
)
from tests.client.common import LONG, PROMPT, PUSHBACK_MS, SHORT, RefuseOnce


def test_the_installed_client_is_tested() -> None:
    """Under the client matrix the package comes from the venv's site-packages, not the source tree."""
    if os.environ.get("ROLLOUT_CLIENT_MATRIX") == "1":
        assert "site-packages" in rollout_grpc.__file__, rollout_grpc.__file__


async def test_client_created_outside_the_loop_works_in_later_loops(target: str) -> None:
    """A module-level client (slime's custom generate module) is used from whichever loop runs."""
    client = await asyncio.to_thread(AsyncRolloutClient, target)  # built with no running loop
    first = await client.generate(PROMPT, SHORT)
    assert first.status == pb.SAMPLE_STATUS_TRUNCATED and first.response_length == 8

    def in_another_loop() -> pb.Sample:
        async def run() -> pb.Sample:
            try:
                done: pb.Sample = await client.generate(PROMPT, SHORT)
                return done
            finally:
                await client.close()

        return asyncio.run(run())

    second = await asyncio.to_thread(in_another_loop)
    assert list(second.tokens) == list(first.tokens)  # greedy: same answer from another loop
    await client.close()


def test_async_client_outside_any_loop_says_what_to_do() -> None:
    client = AsyncRolloutClient("127.0.0.1:1")
    with pytest.raises(RuntimeError, match=r"inside an event loop.*RolloutClient"):
        _ = client.stub


async def test_batch_inputs_tuples_numpy_and_empty(target: str) -> None:
    async with AsyncRolloutClient(target) as client:
        assert await client.generate([]) == []
        assert await client.generate(()) == []
        ids = np.array(PROMPT, dtype=np.int64)
        one = await client.generate(ids, SHORT)
        assert isinstance(one, pb.Sample) and list(one.tokens[:4]) == PROMPT
        assert list(make_sample(ids).tokens) == PROMPT
        as_list = await client.generate(list(ids), SHORT)  # a list of numpy ints is one sample
        assert isinstance(as_list, pb.Sample) and list(as_list.tokens) == list(one.tokens)
        pair = await client.generate((tuple(PROMPT), make_sample(ids)), SHORT)
        assert [list(s.tokens) for s in pair] == [list(one.tokens)] * 2
        grid = await client.generate(np.array([PROMPT, PROMPT]), SHORT)
        assert isinstance(grid, list) and len(grid) == 2  # an array: one or a batch, by its rank
        with pytest.raises(TypeError, match="integers"):
            make_sample([1.5, 2.0])  # type: ignore[list-item]


async def test_one_sample_of_a_batch_can_be_aborted_by_its_request_id(target: str) -> None:
    async with AsyncRolloutClient(target) as client:
        ids = [new_request_id() for _ in range(3)]
        samples = [make_sample(PROMPT, index=i) for i in range(3)]
        batch = asyncio.ensure_future(client.generate(samples, LONG, request_ids=ids))
        deadline = time.monotonic() + 10
        # Wait until the three calls are in flight: an abort that overtakes its call would be sent
        # to the engines as an unknown id (a race this test is not about).
        while (await client.server_info()).in_flight < 3:
            assert time.monotonic() < deadline, "the batch never got in flight"
            await asyncio.sleep(0.005)
        assert (await client.abort(request_ids=[ids[1]])).aborted == 1
        await client.abort(request_ids=[ids[0], ids[2]])
        done = await asyncio.wait_for(batch, 30)
        assert [s.index for s in done] == [0, 1, 2]
        assert all(s.status == pb.SAMPLE_STATUS_ABORTED for s in done)
        assert all(len(s.rollout_log_probs) == s.response_length for s in done)


def _ended_by_the_deadline(outcome: object) -> None:
    """A call ended at its deadline: the replica sends the sample just before it (ABORTED with
    fewer tokens than asked), or a loaded machine missed that margin (DEADLINE_EXCEEDED)."""
    if isinstance(outcome, grpc.RpcError):
        assert outcome.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert isinstance(outcome, pb.Sample), outcome
        assert outcome.status == pb.SAMPLE_STATUS_ABORTED and outcome.response_length < 3000


async def test_client_default_deadline(target: str) -> None:
    async with AsyncRolloutClient(target, timeout=0.2) as client:
        late: object
        try:
            late = await client.generate(PROMPT, LONG)
        except grpc.aio.AioRpcError as exc:
            late = exc
        _ended_by_the_deadline(late)
        done = await client.generate(PROMPT, SHORT, timeout=math.inf)  # per call: no deadline
        assert done.response_length == 8


def test_sync_client_batches_and_default_deadline(target: str) -> None:
    with RolloutClient(target, timeout=30) as client:
        assert client.generate([]) == []
        done = client.generate((PROMPT, np.array(PROMPT)), SHORT)
        assert [s.response_length for s in done] == [8, 8]
    with RolloutClient(target, timeout=0.2) as client:
        late: object
        try:
            late = client.generate(PROMPT, LONG)
        except grpc.RpcError as exc:
            late = exc
        _ended_by_the_deadline(late)


async def test_get_server_info_is_named_after_its_rpc_and_server_info_is_the_same_method(target: str) -> None:
    """Every method is named after its RPC (`get_trajectory`: GetTrajectory) but GetServerInfo's was
    `server_info`; `get_server_info` is the name now, `server_info` stays as the same method."""
    assert RolloutClient.server_info is RolloutClient.get_server_info
    assert AsyncRolloutClient.server_info is AsyncRolloutClient.get_server_info
    with RolloutClient(target, timeout=30) as blocking:
        assert blocking.get_server_info().engines
        version = blocking.get_server_info().version
        assert blocking.server_info().version == version == rollout_grpc.__version__
    async with AsyncRolloutClient(target, timeout=30) as client:
        info = await client.get_server_info(timeout=10)
        assert info.engines and info.version == rollout_grpc.__version__


async def test_unspecified_status_means_pending(target: str) -> None:
    """What every other language sends for a new sample (proto3's zero) generates."""
    async with AsyncRolloutClient(target) as client:
        request = pb.GenerateRequest(sample=pb.Sample(tokens=PROMPT), request_id=new_request_id())
        request.sampling_params.max_new_tokens = 4
        request.sampling_params.ignore_eos = True
        request.options.final_only = True
        finals = [m.sample async for m in client.stub.Generate(request) if m.HasField("sample")]
        assert finals[0].status == pb.SAMPLE_STATUS_TRUNCATED and finals[0].response_length == 4


# ---- the default retry policy honours the server's pushback -------------------------------------


async def test_a_refused_call_is_retried_after_the_servers_pushback(refusing: tuple[str, RefuseOnce]) -> None:
    address, fake = refusing
    async with AsyncRolloutClient(address) as client:
        info = await client.server_info(timeout=10)
        assert info.in_flight == 7
        assert len(fake.arrivals) == 2
        assert fake.arrivals[1] - fake.arrivals[0] >= PUSHBACK_MS / 1000
        fake.arrivals.clear()
        done = await client.generate(PROMPT, timeout=10)  # the streaming call too
        assert list(done.tokens) == PROMPT and len(fake.arrivals) == 2


async def test_the_blocking_client_retries_too(refusing: tuple[str, RefuseOnce]) -> None:
    address, fake = refusing
    with RolloutClient(address) as client:
        info = await asyncio.to_thread(client.server_info, timeout=10)  # the fake serves in this loop
    assert info.in_flight == 7 and len(fake.arrivals) == 2
    assert fake.arrivals[1] - fake.arrivals[0] >= PUSHBACK_MS / 1000


async def test_without_a_retry_policy_the_refusal_reaches_the_caller(
    refusing: tuple[str, RefuseOnce],
) -> None:
    address, fake = refusing
    async with AsyncRolloutClient(address, retry=None) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.server_info(timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(fake.arrivals) == 1


def test_retry_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=9).service_config()
