"""Routed experts (R3): encoding, row coverage, determinism across continuations, abort, switches."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np

from rollout_grpc.sim.moe import decode_npy_b64, routed_experts
from tests.support.conformance import assert_same_shape, parse_sse, shape_of
from tests.support.sim_http import PROMPT, EngineFactory, generate, golden, post

MOE = golden("r_moe")["moe"]
R3 = {"return_routed_experts": True, "moe_layers": 2, "moe_experts": 8, "moe_topk": 2, "eos_probability": 0.0}


def _decode(s: Any) -> np.ndarray:
    assert isinstance(s, str)
    arr = decode_npy_b64(s)
    assert isinstance(arr, np.ndarray)
    return arr


async def test_disabled_matches_recording(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(model="tiny-qwen3moe", max_model_len=512, eos_probability=0.0) as eng:
        rec = MOE["generate_routed_experts"]
        r = await generate(session, eng.url, rec["request"])
        assert_same_shape(rec["body"], r.json)
        assert r.json["choices"][0]["routed_experts"] is None
        srec = MOE["stream_routed_experts_prompt_start4"]
        events = (await generate(session, eng.url, srec["request"])).events
        assert [shape_of(e) for e in events] == [shape_of(e) for e in parse_sse(srec["raw_sse"])]


async def test_nonstream_shape_rows_dtype(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(**R3) as eng:
        rec = MOE["generate_routed_experts"]
        body = (await generate(session, eng.url, rec["request"])).json
        want = {**rec["body"]["choices"][0], "routed_experts": "str"}
        got_shape = dict(shape_of(body["choices"][0])["{}"])
        assert list(got_shape) == list(want)
        arr = _decode(body["choices"][0]["routed_experts"])
        assert arr.dtype == np.uint8
        assert arr.shape == (20 + 5 - 1, 2, 2)
        assert arr.max() < 8
        assert all(len(set(row)) == 2 for row in arr.reshape(-1, 2).tolist())  # top-k ids are distinct


async def test_stream_final_chunk_only(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(**R3) as eng:
        srec = MOE["stream_routed_experts_prompt_start4"]
        events = (await generate(session, eng.url, srec["request"])).events
        chunks = [e for e in events if isinstance(e, dict)]
        assert all(c["choices"][0]["routed_experts"] is None for c in chunks[:-1])
        arr = _decode(chunks[-1]["choices"][0]["routed_experts"])
        assert arr.shape == (20 - 4 + 3 - 1, 2, 2)


async def test_rows_are_stable_across_continuation(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    """Re-prefilling prompt + partial output reproduces the rows of the shared positions."""
    async with make_engine(**R3) as eng:

        async def greedy(ids: list[int], n: int) -> dict[str, Any]:
            body = {"token_ids": ids, "sampling_params": {"max_tokens": n, "temperature": 0}}
            choice: dict[str, Any] = (await generate(session, eng.url, body)).json["choices"][0]
            return choice

        whole = await greedy(PROMPT, 10)
        out = whole["token_ids"]
        cont = await greedy(PROMPT + out[:4], 6)
        assert cont["token_ids"] == out[4:]  # greedy continuation = the uninterrupted run
        a = _decode(whole["routed_experts"])
        b = _decode(cont["routed_experts"])
        assert a.shape == b.shape == (20 + 10 - 1, 2, 2)
        assert np.array_equal(a, b)
        other = _decode((await greedy(PROMPT[:10], 3))["routed_experts"])
        assert np.array_equal(other[:10], a[:10])  # a row depends on (position, layer, token) only


async def test_prompt_start_and_validation(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    async with make_engine(**R3) as eng:
        base = (
            await generate(
                session,
                eng.url,
                {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "temperature": 0}},
            )
        ).json
        sliced = (
            await generate(
                session,
                eng.url,
                {
                    "token_ids": PROMPT,
                    "sampling_params": {"max_tokens": 3, "temperature": 0, "routed_experts_prompt_start": 20},
                },
            )
        ).json
        a = _decode(base["choices"][0]["routed_experts"])
        b = _decode(sliced["choices"][0]["routed_experts"])
        assert b.shape == (2, 2, 2) and np.array_equal(a[20:], b)
        for bad in (-1, 21):
            r = await generate(
                session,
                eng.url,
                {
                    "token_ids": PROMPT,
                    "sampling_params": {"max_tokens": 1, "routed_experts_prompt_start": bad},
                },
            )
            assert r.status == 400
            assert r.json["error"]["param"] == "routed_experts_prompt_start"
        assert eng.stats.generate_started == 2


async def test_abort_gives_rows_so_far(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(token_delay_s=0.002, **R3) as eng:
        task = asyncio.create_task(
            generate(
                session,
                eng.url,
                {"request_id": "r3", "token_ids": PROMPT, "sampling_params": {"max_tokens": 3000}},
            )
        )
        await eng.wait_for_tokens("generate-tokens-r3", 7)
        await post(session, eng.url + "/abort_requests", {"request_ids": ["generate-tokens-r3"]})
        ch = (await task).json["choices"][0]
        assert ch["finish_reason"] == "abort"
        assert _decode(ch["routed_experts"]).shape == (20 + len(ch["token_ids"]) - 1, 2, 2)
        # a request aborted before any forward pass has no rows at all
        await post(session, eng.url + "/pause?mode=keep")
        held = asyncio.create_task(
            generate(session, eng.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5}})
        )
        await eng.wait_for_held(1)
        await post(session, eng.url + "/abort_requests", {})
        assert (await held).json["choices"][0]["routed_experts"] is None
        await post(session, eng.url + "/resume")


async def test_unavailable_switch_and_uint16(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    async with make_engine(**R3) as eng:
        eng.faults.routed_experts_unavailable = True
        r = await generate(session, eng.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
        assert r.json["choices"][0]["routed_experts"] is None
    arr = routed_experts(list(range(40)), 0, 39, num_layers=3, num_experts=300, topk=4, seed=0)
    assert arr.dtype == np.uint16 and arr.shape == (39, 3, 4) and int(arr.max()) < 300
