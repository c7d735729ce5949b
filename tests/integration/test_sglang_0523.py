"""The SGLang adapter against SGLang 0.5.23's behaviours, as the simulator models them
(docs/sglang-http-api.md): each test fails on the adapter before these were handled."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rollout_grpc.server.domain.model import SamplingParams
from rollout_grpc.server.engines.api import EngineDelta, EngineRejected, EngineUsage, FinishKind
from rollout_grpc.server.engines.sglang import wire
from rollout_grpc.server.engines.sglang.wire import engine_request_id
from rollout_grpc.sim.config import SGLangOptions
from tests.support.sglang_adapter import PROMPT, call, call_id, collect, joined, sglang

#: Generous bound that only a wedged engine reaches (the simulator answers in milliseconds).
HANG_S = 30.0


async def test_abort_pause_over_a_keep_pause_does_not_wedge_the_engine() -> None:
    """0.5.23: an abort pause over in_place waits forever (TM:2267-2286); the adapter continues first."""
    async with sglang(token_delay_s=0.01) as (_, adapter):
        gen = adapter.generate(call(max_tokens=None))
        first = await anext(gen)
        await adapter.pause("keep")
        async with asyncio.timeout(HANG_S):
            await adapter.pause("abort")
            tokens, logprobs, _, final = joined([first, *[e async for e in gen]])
            await adapter.resume()
    assert final.finish is FinishKind.ABORT and tokens and len(logprobs) == len(tokens)


async def test_queued_abort_echo_under_incremental_streaming_ends_aborted_with_every_token() -> None:
    """0.5.23 TM:3628-3630: the echo's output_ids is only the last id, completion_tokens all."""
    async with (
        sglang(incremental=True, token_delay_s=0.01) as (sim, adapter),
        aiohttp.ClientSession() as http,
    ):
        gen = adapter.generate(call("q", max_tokens=None))
        events = [await anext(gen)]
        while sum(len(e.token_ids) for e in events if isinstance(e, EngineDelta)) < 3:
            events.append(await anext(gen))
        async with http.post(f"{sim.url}/pause_generation", json={"mode": "retract"}) as r:
            assert r.status == 200
        await adapter.abort_requests([engine_request_id(call_id("q"))])
        events += [e async for e in gen]
        async with http.post(f"{sim.url}/continue_generation", json={}) as r:
            assert r.status == 200
    tokens, logprobs, _, final = joined(events)
    (usage,) = [e for e in events if isinstance(e, EngineUsage)]
    assert final.finish is FinishKind.ABORT and len(tokens) >= 3 and len(logprobs) == len(tokens)
    assert usage.prompt_tokens == len(PROMPT)  # the echo has none: the earlier chunks' count


async def test_a_seeded_call_is_refused_where_sglang_ignores_seeds() -> None:
    seeded = SamplingParams(temperature=1.0, seed=7)
    async with sglang() as (_, adapter):
        caps = await adapter.capabilities("warn")
        with pytest.raises(EngineRejected) as err:
            await collect(adapter, call(sampling=seeded))
    assert err.value.param == "seed" and "--enable-deterministic-inference" in err.value.message
    assert any("--enable-deterministic-inference" in w for w in caps.warnings)
    assert any("--incremental-streaming-output" in w for w in caps.warnings)
    deterministic = SGLangOptions(enable_deterministic_inference=True)
    async with sglang(sglang_options=deterministic) as (_, adapter):
        await adapter.capabilities("warn")
        a = joined(await collect(adapter, call("a", sampling=seeded)))[0]
        b = joined(await collect(adapter, call("b", sampling=seeded)))[0]
    assert a == b


async def test_logprob_definition_is_reported_and_refuse_holds_truncating_calls() -> None:
    async with sglang() as (_, adapter):
        caps = await adapter.capabilities("refuse")
        with pytest.raises(EngineRejected) as err:
            await collect(adapter, call(sampling=SamplingParams(temperature=1.0, top_p=0.5)))
        assert len(joined(await collect(adapter, call()))[0]) == 8
    assert caps.logprobs_mode == "temperature_scaled_logprobs"
    assert err.value.param == "top_p" and "--raw-logprobs" in err.value.message


async def test_an_abort_of_a_call_held_by_a_pause_ends_it_and_is_not_lost() -> None:
    """0.5.23 TM:2241-2253: an abort of a call SGLang holds is lost; the adapter holds it itself."""
    async with sglang(token_delay_s=0.005) as (sim, adapter):
        await adapter.pause("keep")
        task = asyncio.ensure_future(collect(adapter, call("h", max_tokens=8)))
        while not adapter._held:  # the call is held (by the adapter, or on old code by the engine)
            if sim.core.stats.generate_requests:
                break
            await asyncio.sleep(0)
        await adapter.abort_requests([engine_request_id(call_id("h"))])
        await adapter.resume()
        async with asyncio.timeout(HANG_S):
            events = await task
    tokens, _, _, final = joined(events)
    assert final.finish is FinishKind.ABORT and tokens == []


def test_the_contract_gates_bare_string_error_names_the_field() -> None:
    body = b'{"error":"unknown field `typical_p`, expected one of `max_new_tokens`, `stop`"}'
    error = wire.http_error("u", 400, body)
    assert isinstance(error, EngineRejected) and error.param == "typical_p"
    assert error.message.startswith("unknown field `typical_p`")
