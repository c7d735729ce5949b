"""The SGLang adapter against the simulated SGLang over real HTTP (docs/sglang-http-api.md).

Each test drives `SglangEngine` the way the rollout does and checks the neutral events: deltas
from cumulative and incremental streams, logprob triples, finish objects, weight-version spans,
raw int32 routing, prefix-free abort by rid, the pause modes (wait emulated) and the errors.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from rollout_grpc.server.domain.chat import ChatRenderRequest
from rollout_grpc.server.domain.errors import FailedPrecondition
from rollout_grpc.server.domain.model import MultimodalFeatures, MultimodalItem, SamplingParams
from rollout_grpc.server.engines.api import (
    EngineDelta,
    EngineEvent,
    EngineRejected,
    EngineUsage,
    FinishKind,
)
from rollout_grpc.server.engines.sglang.adapter import SglangEngine
from rollout_grpc.server.engines.sglang.wire import engine_request_id
from tests.support.multimodal import png
from tests.support.sglang_adapter import PROMPT, call, call_id, collect, joined, sglang


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_a_stream_becomes_deltas_with_one_logprob_per_token(incremental: bool) -> None:
    async with sglang(incremental) as (sim, adapter):
        events = await collect(adapter, call(max_tokens=12))
        body = sim.core.stats.last_requests[-1]
    tokens, logprobs, text, final = joined(events)
    assert len(tokens) == 12 and len(logprobs) == 12 and all(lp <= 0 for lp in logprobs)
    assert text  # the toy tokenizer's text, delta by delta
    assert final.finish is FinishKind.LENGTH and final.stop_reason is None
    assert [(s.version, s.start, s.end) for s in final.weight_spans] == [("default", 0, 12)]
    (usage,) = [e for e in events if isinstance(e, EngineUsage)]
    assert usage.prompt_tokens == len(PROMPT)
    # What went on the wire: SGLang's names only, the rid prefix-free, logprobs asked for.
    assert body["rid"] == call_id("r") and body["return_logprob"] is True and body["stream"] is True
    assert body["sampling_params"]["max_new_tokens"] == 12
    assert body["sampling_params"]["no_stop_trim"] is True
    assert "include_stop_str_in_output" not in body["sampling_params"]


async def test_cumulative_and_incremental_streams_give_the_same_sample() -> None:
    results = []
    for incremental in (False, True):
        async with sglang(incremental) as (_, adapter):
            results.append(joined(await collect(adapter, call(max_tokens=10)))[:3])
    assert results[0] == results[1]


async def test_no_budget_is_sent_as_null_not_left_to_sglangs_128() -> None:
    async with sglang(max_model_len=64) as (sim, adapter):
        tokens, _, _, final = joined(await collect(adapter, call(max_tokens=None)))
        assert sim.core.stats.last_requests[-1]["sampling_params"]["max_new_tokens"] is None
    # SGLang's scheduler stops two tokens short of the context (docs/sglang-http-api.md §2.2).
    assert final.finish is FinishKind.LENGTH and len(tokens) == 64 - len(PROMPT) - 2


async def test_a_budget_over_the_context_is_capped_so_the_call_ends_length_as_on_vllm() -> None:
    # SGLang refuses prompt + max_new_tokens > context (docs/sglang-http-api.md §2.2).
    async with sglang(max_model_len=64) as (sim, adapter):
        await adapter.capabilities("warn")
        over = dataclasses.replace(call(max_tokens=100), min_tokens=90)
        tokens, _, _, final = joined(await collect(adapter, over))
        sent = sim.core.stats.last_requests[-1]["sampling_params"]
    room = 64 - len(PROMPT)
    assert sent["max_new_tokens"] == sent["min_new_tokens"] == room
    # Admitted (not refused), then capped by SGLang's scheduler two tokens short of the context.
    assert final.finish is FinishKind.LENGTH and len(tokens) == room - 2


async def test_stop_token_and_stop_string_reasons() -> None:
    async with sglang() as (_, adapter):
        first, _, text, _ = joined(await collect(adapter, call(max_tokens=6)))
        stop_id = first[3]
        tokens, _, _, final = joined(
            await collect(adapter, call(sampling=SamplingParams(temperature=0.0, stop_token_ids=[stop_id])))
        )
        assert final.finish is FinishKind.STOP and final.stop_reason == stop_id
        assert tokens[-1] == stop_id
        stop = text[len(text) // 2 :][:2]
        _, _, stopped_text, final = joined(
            await collect(adapter, call(sampling=SamplingParams(temperature=0.0, stop=[stop])))
        )
        assert final.finish is FinishKind.STOP and final.stop_reason == stop
        assert stopped_text.endswith(stop)  # no_stop_trim: the stop string stays (slime's default)


async def test_eos_is_a_stop_without_reason() -> None:
    async with sglang(eos_probability=1.0) as (_, adapter):
        _, _, _, final = joined(await collect(adapter, call(max_tokens=50)))
    assert final.finish is FinishKind.STOP and final.stop_reason is None


async def test_abort_by_rid_keeps_the_tokens_and_does_not_reach_a_longer_rid() -> None:
    async with sglang(token_delay_s=0.01) as (_, adapter):
        one, ten = adapter.generate(call("q", 1, None)), adapter.generate(call("q", 10, 30))
        first_one, first_ten = await anext(one), await anext(ten)
        assert isinstance(first_one, EngineDelta) and isinstance(first_ten, EngineDelta)
        await adapter.abort_requests([engine_request_id(call_id("q", 1))])
        rest_one = [first_one, *[e async for e in one]]
        rest_ten = [first_ten, *[e async for e in ten]]
    tokens, logprobs, _, final = joined(rest_one)
    assert final.finish is FinishKind.ABORT and tokens and len(logprobs) == len(tokens)
    tokens, _, _, final = joined(rest_ten)
    assert final.finish is FinishKind.LENGTH and len(tokens) == 30  # "…~q~1~" is no prefix of "…~q~10~"


async def test_pause_keep_holds_and_resume_continues_exactly() -> None:
    async with sglang() as (_, reference):
        expected = joined(await collect(reference, call(max_tokens=20)))[0]
    async with sglang(token_delay_s=0.005) as (sim, adapter):
        gen = adapter.generate(call(max_tokens=20))
        first = await anext(gen)
        await adapter.pause("keep")
        assert await adapter.is_paused()
        assert sim.core.stats.last_requests  # the engine got the call before the pause
        await adapter.resume()
        assert not await adapter.is_paused()
        tokens = joined([first, *[e async for e in gen]])[0]
    assert tokens == expected


async def test_pause_wait_lets_running_calls_finish_then_pauses() -> None:
    async with sglang(token_delay_s=0.002) as (_, adapter):
        gen = adapter.generate(call(max_tokens=15))
        first = await anext(gen)
        rest = asyncio.ensure_future(_rest(gen))
        await adapter.pause("wait", timeout=None)
        assert rest.done()  # the pause answered only once the call had finished
        tokens, _, _, final = joined([first, *rest.result()])
        assert final.finish is FinishKind.LENGTH and len(tokens) == 15
        assert await adapter.is_paused()
        await adapter.resume()
        assert len(joined(await collect(adapter, call(max_tokens=3)))[0]) == 3


async def _rest(gen: AsyncIterator[EngineEvent]) -> list[EngineEvent]:
    return [e async for e in gen]


async def test_pause_abort_ends_running_calls_with_their_tokens() -> None:
    async with sglang(token_delay_s=0.01) as (_, adapter):
        gen = adapter.generate(call(max_tokens=None))
        first = await anext(gen)
        await adapter.pause("abort")
        tokens, _, _, final = joined([first, *[e async for e in gen]])
        await adapter.resume()
    assert final.finish is FinishKind.ABORT and tokens


async def test_a_weight_version_update_aborts_nothing_and_splits_the_spans() -> None:
    async with sglang(token_delay_s=0.005) as (_, adapter):
        gen = adapter.generate(call(max_tokens=20))
        first = await anext(gen)
        await adapter.update_weight_version("v2")
        tokens, _, _, final = joined([first, *[e async for e in gen]])
        assert await adapter.weight_version() == "v2"
    assert final.finish is FinishKind.LENGTH and len(tokens) == 20
    versions = [s.version for s in final.weight_spans]
    assert versions == ["default", "v2"]
    assert final.weight_spans[0].start == 0 and final.weight_spans[-1].end == 20
    assert final.weight_spans[0].end == final.weight_spans[1].start


async def test_a_value_sglang_refuses_names_the_knob() -> None:
    async with sglang() as (_, adapter):
        with pytest.raises(EngineRejected) as err:
            await collect(adapter, call(sampling=SamplingParams(repetition_penalty=3.0)))
    assert err.value.param == "repetition_penalty" and "(0, 2]" in err.value.message


async def test_an_over_long_prompt_is_a_prompt_rejection() -> None:
    async with sglang(max_model_len=4) as (_, adapter):
        with pytest.raises(EngineRejected) as err:
            await collect(adapter, call())
    assert err.value.param == "prompt"


async def test_a_prompt_the_scheduler_refuses_is_a_prompt_rejection() -> None:
    """Within six tokens of the context the tokenizer admits the prompt and SGLang's scheduler
    refuses it: the stream's last chunk is a 400 abort, `Input length (…) exceeds …`."""
    async with sglang(max_model_len=len(PROMPT) + 3) as (_, adapter):
        with pytest.raises(EngineRejected) as err:
            await collect(adapter, call(max_tokens=2))
    assert err.value.param == "prompt" and err.value.message.startswith("Input length (")


async def test_routed_experts_decode_to_rows_layers_topk() -> None:
    moe: dict[str, Any] = {"moe_experts": 8, "moe_layers": 3, "moe_topk": 2, "return_routed_experts": True}
    async with sglang(topk=2, **moe) as (_, adapter):
        caps = await adapter.capabilities("warn")
        _, _, _, final = joined(await collect(adapter, call(max_tokens=6, return_routed_experts=True)))
    assert caps.routed_experts is True and caps.routed_experts_problem("u") is None
    array = final.routed_experts
    assert array is not None and array.dtype == np.dtype("<i4")
    assert array.shape == (len(PROMPT) + 6 - 1, 3, 2)
    assert ((array >= 0) & (array < 8)).all()


async def test_routing_without_a_configured_topk_is_reported_not_guessed() -> None:
    moe: dict[str, Any] = {"moe_experts": 8, "return_routed_experts": True}
    async with sglang(**moe) as (_, adapter):
        caps = await adapter.capabilities("warn")
    assert caps.routed_experts is False
    problem = caps.routed_experts_problem("u")
    assert problem is not None and "--sglang-experts-topk" in problem
    assert any("--sglang-experts-topk" in w for w in caps.warnings)


async def test_capabilities_health_and_models() -> None:
    async with sglang(max_model_len=512) as (sim, adapter):
        caps = await adapter.capabilities("refuse")
        assert caps.model == sim.config.model and caps.max_model_len == 512 and not caps.problems
        assert await adapter.health()
        sim.core.config.faults.dead = True
        health = await adapter.health()
        assert not health and health.cause == "GET /health answered HTTP 503"
        url = sim.url
    async with aiohttp.ClientSession() as http:
        gone = await SglangEngine(url, http).health(0.5)
    assert not gone and "connection refused" in gone.cause


async def test_render_is_refused_with_the_reason() -> None:
    async with sglang() as (_, adapter):
        with pytest.raises(FailedPrecondition, match="no render route"):
            await adapter.render_text("hello")
        with pytest.raises(FailedPrecondition, match="no render route"):
            await adapter.render_chat(ChatRenderRequest([{"role": "user", "content": "hi"}]))


def test_engine_rids_are_prefix_free() -> None:
    rids = [engine_request_id(call_id(r, a)) for r in ("a", "ab", "a1", "a~1") for a in (0, 1, 10, 11)]
    assert len(set(rids)) == len(rids)
    assert not [(x, y) for x in rids for y in rids if x != y and y.startswith(x)]


async def test_media_go_as_image_data_with_one_placeholder_each() -> None:
    """SGLang expands placeholders itself: the sample's expanded run goes back to one placeholder
    and the image rides in `image_data`; the engine's expansion gives the sample's prompt length."""
    image = "data:image/png;base64," + base64.b64encode(png()).decode()
    tokens = [*PROMPT[:2], 6, 6, 6, 6, *PROMPT[2:]]  # 56x56 -> 4 placeholder tokens
    item = MultimodalItem("h", offset=2, length=4, kwargs_data=image.encode(), placeholder_token_id=6)
    features = MultimodalFeatures({"image": [item]})
    async with sglang(multimodal=True) as (sim, adapter):
        c = dataclasses.replace(call(max_tokens=4), prompt_token_ids=tokens, features=features)
        events = await collect(adapter, c)
        body = sim.core.stats.last_requests[-1]
    assert body["input_ids"] == [*PROMPT[:2], 6, *PROMPT[2:]] and body["image_data"] == [image]
    (usage,) = [e for e in events if isinstance(e, EngineUsage)]
    assert usage.prompt_tokens == len(tokens)
    assert len(joined(events)[0]) == 4


async def test_cached_media_without_the_image_are_refused() -> None:
    item = MultimodalItem("h", offset=2, length=4, kwargs_data=None, placeholder_token_id=6)
    c = dataclasses.replace(call(), features=MultimodalFeatures({"image": [item]}))
    async with sglang(multimodal=True) as (_, adapter):
        with pytest.raises(EngineRejected, match="takes images"):
            await collect(adapter, c)
