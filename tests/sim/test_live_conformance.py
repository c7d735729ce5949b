"""The simulator next to a live vLLM 0.32 server: same requests, same answers' structure.

Runs only in the vLLM tier (``pytest -m vllm``, ``ROLLOUT_VLLM=1``; see ``tests/vllm/fixtures.py``).
Each test sends identical requests to the live server and to a simulator configured like it
(served name and ``max_model_len`` read from its ``/v1/models``) and compares status, content
type, structure (``shape_of``: keys, key order, types, nulls) and, for errors, the exact bodies.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from PIL import Image

from rollout_grpc.sim import SimConfig, SimEngine
from tests.support.conformance import assert_same_shape, stream_shape_diff
from tests.support.sim_http import PROMPT, Reply, call

pytestmark = pytest.mark.vllm

Pair = tuple[Reply, Reply]


class Both:
    """Send one request to the simulator and to the live server."""

    def __init__(self, session: aiohttp.ClientSession, sim: SimEngine, live: str) -> None:
        self.session, self.sim, self.live = session, sim, live

    async def __call__(self, method: str, path: str, body: Any = None, **kw: Any) -> Pair:
        s = await call(self.session, method, self.sim.url + path, body, **kw)
        v = await call(self.session, method, self.live + path, body, **kw)
        assert (s.status, s.content_type) == (v.status, v.content_type), (path, s.raw[:300], v.raw[:300])
        return s, v


@contextlib.asynccontextmanager
async def _both(live: str, **extra: Any) -> AsyncIterator[Both]:
    async with aiohttp.ClientSession() as session:
        async with session.get(live + "/v1/models") as r:
            model = (await r.json())["data"][0]
        cfg = SimConfig(
            model=model["id"], model_root=model["root"], max_model_len=model["max_model_len"], **extra
        )
        async with SimEngine(cfg) as sim:
            yield Both(session, sim, live)


def _gen(**sp: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "sampling_params": sp}


GENERATE_CASES: list[dict[str, Any]] = [
    {
        **_gen(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True),
        "request_id": "c-1",
        "return_token_ids": True,
    },
    _gen(max_tokens=3, temperature=1.0, seed=7, logprobs=0, ignore_eos=True),
    {**_gen(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True), "output_mode": "text"},
    _gen(max_tokens=3, temperature=1.0, n=2, seed=1, ignore_eos=True),
    _gen(max_tokens=5, temperature=0, logit_bias={"2": 100.0}, logprobs=0),
    {**_gen(max_tokens=1, temperature=0, bogus_sp=1), "bogus_top": 1},
    _gen(max_tokens=2, temperature=0, detokenize=False, ignore_eos=True),
    _gen(max_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True),
    _gen(max_tokens=4, temperature=0, logprob_token_ids=[5, 6, 7], ignore_eos=True),
]


@pytest.mark.parametrize("body", GENERATE_CASES)
async def test_generate_like_live(vllm_dense_url: str, body: dict[str, Any]) -> None:
    async with _both(vllm_dense_url) as both:
        s, v = await both("POST", "/inference/v1/generate", body)
        assert_same_shape(v.json, s.json)


@pytest.mark.parametrize(
    "extra",
    [
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "return_token_ids": True},
        {},
        {"output_mode": "text"},
        {"stream_options": {"include_usage": True}},
    ],
)
async def test_stream_like_live(vllm_dense_url: str, extra: dict[str, Any]) -> None:
    async with _both(vllm_dense_url) as both:
        body = {**_gen(max_tokens=4, temperature=0, logprobs=1, ignore_eos=True), "stream": True, **extra}
        s, v = await both("POST", "/inference/v1/generate", body)
        assert stream_shape_diff(v.events, s.events) == []


ERROR_BODIES: list[Any] = [
    {"token_ids": PROMPT},
    {"token_ids": [], "sampling_params": {}},
    {"token_ids": [-1, 5], "sampling_params": {}},
    {"token_ids": [999999], "sampling_params": {"max_tokens": 1}},
    {"model": "nope", **_gen(max_tokens=1)},
    _gen(max_tokens=1, logprobs=50),
    _gen(max_tokens=1, temperature=-1),
    _gen(max_tokens=1, temperature=2.5),
    _gen(max_tokens=1, top_p=0),
    _gen(max_tokens=1, n=100000),
    _gen(max_tokens=0),
    _gen(max_tokens=2, temperature=0, n=2),
    _gen(max_tokens=1, stop_token_ids=[999999]),
    _gen(max_tokens=1, logit_bias={"999999": 1}),
    _gen(max_tokens=1, routed_experts_prompt_start=99),
    _gen(max_tokens=1, min_tokens=5),
    {**_gen(max_tokens=1, detokenize=False), "output_mode": "text"},
    {**_gen(max_tokens=1), "cache_salt": ""},
    {**_gen(max_tokens=1), "output_mode": "bytes"},
    ["not", "an", "object"],
]


@pytest.mark.parametrize("body", ERROR_BODIES)
async def test_errors_like_live(vllm_dense_url: str, body: Any) -> None:
    async with _both(vllm_dense_url) as both:
        s, v = await both("POST", "/inference/v1/generate", body)
        assert s.json == v.json


#: Errors vLLM's engine finds while processing the input: with ``stream: true`` they come as HTTP 200
#: and one error event (then ``[DONE]``), not as an HTTP status.
IN_STREAM_ERROR_BODIES: list[Any] = [
    {"token_ids": [*PROMPT, 999999], "sampling_params": {"max_tokens": 1}},
    _gen(max_tokens=1, stop_token_ids=[999999]),
    _gen(max_tokens=1, logit_bias={"999999": 1}),
]


@pytest.mark.parametrize("body", IN_STREAM_ERROR_BODIES)
async def test_in_stream_errors_like_live(vllm_dense_url: str, body: dict[str, Any]) -> None:
    async with _both(vllm_dense_url) as both:
        s, v = await both("POST", "/inference/v1/generate", {**body, "stream": True})
        assert s.status == 200
        assert s.raw == v.raw


async def test_in_stream_too_long_prompt_like_live(vllm_dense_url: str) -> None:
    async with _both(vllm_dense_url) as both:
        n = both.sim.config.max_model_len
        body = {"token_ids": [5] * (n + 10), "sampling_params": {"max_tokens": 1}, "stream": True}
        s, v = await both("POST", "/inference/v1/generate", body)
        assert s.status == 200
        assert s.raw == v.raw


async def test_request_level_errors_like_live(vllm_dense_url: str) -> None:
    async with _both(vllm_dense_url) as both:
        n = both.sim.config.max_model_len
        for body in ({"token_ids": [5] * (n + 10), "sampling_params": {"max_tokens": 1}},):
            s, v = await both("POST", "/inference/v1/generate", body)
            assert s.json == v.json
        json_ct = {"Content-Type": "application/json"}
        for data, headers in ((b"{not json", json_ct), (b"hello", {"Content-Type": "text/plain"})):
            s, v = await both("POST", "/inference/v1/generate", data=data, headers=headers)
            assert s.json == v.json
        for path, data in (("/inference/v1/abort_requests", b"{}"), ("/inference/v1/abort_requests", b"")):
            s, v = await both("POST", path, data=data, headers=json_ct)
            assert s.json == v.json
        s, v = await both("POST", "/pause?mode=bogus")
        assert s.json == v.json
        for path in ("/abort_requests",):
            s, v = await both("POST", path, data=b"", headers=json_ct)
            assert s.json == v.json


async def test_meta_like_live(vllm_dense_url: str) -> None:
    async with _both(vllm_dense_url) as both:
        for path in ("/health", "/ping"):
            s, v = await both("GET", path)
            assert s.raw == v.raw == b""
        for path in ("/version", "/load", "/is_paused", "/get_world_size", "/is_sleeping"):
            s, v = await both("GET", path)
            assert s.json == v.json
        s, v = await both("GET", "/weight_info")  # the live server is shared: its version may differ
        assert_same_shape(v.json, s.json)
        s, v = await both("GET", "/v1/models")
        assert_same_shape(v.json, s.json)
        for body in (
            {"prompt": "Hello world! What is two plus two?", "return_token_strs": True},
            {"messages": [{"role": "user", "content": "What is two plus two?"}]},
        ):
            s, v = await both("POST", "/tokenize", body)
            assert_same_shape(v.json, s.json)
        s, v = await both("POST", "/detokenize", {"tokens": PROMPT})
        assert_same_shape(v.json, s.json)  # the vocabularies differ beyond the special tokens
        posts: list[tuple[str, Any]] = [
            ("/reset_prefix_cache", None),
            ("/update_weight_version", {"new_version": "default"}),
        ]
        for path, payload in posts:
            s, v = await both("POST", path, payload)
            assert s.json == v.json


async def test_render_like_live(vllm_dense_url: str) -> None:
    async with _both(vllm_dense_url) as both:
        chat = {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "temperature": 0.5,
            "top_p": 0.9,
            "max_tokens": 7,
            "stop": ["zz"],
            "stop_token_ids": [9, 3],
            "seed": 4,
        }
        s, v = await both("POST", "/v1/chat/completions/render", chat)
        assert_same_shape(v.json, s.json)
        assert s.json["sampling_params"] == v.json["sampling_params"]
        s, v = await both("POST", "/v1/completions/render", {"prompt": ["a", "b"], "max_tokens": 16})
        assert_same_shape(v.json, s.json)
        assert [x["sampling_params"] for x in s.json] == [x["sampling_params"] for x in v.json]
        s, v = await both("POST", "/v1/completions/render", {"prompt": ["Hello", [1, 2, 3]], "max_tokens": 3})
        assert s.json == v.json


async def test_moe_without_flag_like_live(vllm_moe_url: str) -> None:
    async with _both(vllm_moe_url) as both:
        body = {
            **_gen(max_tokens=3, temperature=0, ignore_eos=True, routed_experts_prompt_start=4),
            "stream": True,
        }
        s, v = await both("POST", "/inference/v1/generate", body)
        assert stream_shape_diff(v.events, s.events) == []
        s, v = await both(
            "POST", "/inference/v1/generate", _gen(max_tokens=3, temperature=0, ignore_eos=True)
        )
        assert_same_shape(v.json, s.json)
        assert s.json["choices"][0]["routed_experts"] is v.json["choices"][0]["routed_experts"] is None


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (10, 120, 200)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def test_multimodal_like_live(vllm_vl_url: str) -> None:
    async with _both(vllm_vl_url, multimodal=True) as both:
        content = [
            {"type": "image_url", "image_url": {"url": _png()}},
            {"type": "text", "text": "What is this?"},
        ]
        chat = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
        s, v = await both("POST", "/v1/chat/completions/render", chat)
        assert_same_shape(v.json, s.json)
        # the same placeholder length and pad count (offsets depend on how "user" is tokenized)
        lengths = [[p["length"] for p in x["features"]["mm_placeholders"]["image"]] for x in (s.json, v.json)]
        assert lengths[0] == lengths[1]
        assert s.json["token_ids"].count(6) == v.json["token_ids"].count(6)
        rendered_s, rendered_v = s.json, v.json
        s = await call(
            both.session,
            "POST",
            both.sim.url + "/inference/v1/generate",
            {**rendered_s, "return_token_ids": True},
        )
        v = await call(
            both.session,
            "POST",
            both.live + "/inference/v1/generate",
            {**rendered_v, "return_token_ids": True},
        )
        assert s.status == v.status == 200
        assert_same_shape(v.json, s.json)
        bad = {"mm_placeholders": {"image": [{"offset": len(rendered_v["token_ids"]) - 1, "length": 4}]}}
        s = await call(
            both.session,
            "POST",
            both.sim.url + "/inference/v1/generate",
            {**rendered_s, "features": {**rendered_s["features"], **bad}},
        )
        v = await call(
            both.session,
            "POST",
            both.live + "/inference/v1/generate",
            {**rendered_v, "features": {**rendered_v["features"], **bad}},
        )
        assert (s.status, s.json["error"]["type"]) == (v.status, v.json["error"]["type"])
        unknown = {
            "mm_hashes": {"image": ["0" * 64]},
            "mm_placeholders": rendered_v["features"]["mm_placeholders"],
            "kwargs_data": None,
            "mm_metadata": None,
        }
        s = await call(
            both.session, "POST", both.sim.url + "/inference/v1/generate", {**rendered_s, "features": unknown}
        )
        v = await call(
            both.session, "POST", both.live + "/inference/v1/generate", {**rendered_v, "features": unknown}
        )
        assert (s.status, s.json) == (v.status, v.json)


async def _stream_until(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], started: Any
) -> list[Any]:
    """Run a streaming generate; set ``started`` after 5 chunks; return the parsed events."""
    events: list[Any] = []
    async with session.post(url + "/inference/v1/generate", json=body) as r:
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                line, buf = buf.split(b"\n\n", 1)
                payload = line.removeprefix(b"data: ")
                events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
                if len(events) == 5:
                    started.set()
    return events


async def _abort_scenario(session: aiohttp.ClientSession, url: str, tag: str) -> tuple[Any, list[Any]]:
    started = asyncio.Event()
    long = {"max_tokens": 3000, "ignore_eos": True, "temperature": 1.0, "logprobs": 0}
    st = asyncio.create_task(
        _stream_until(
            session,
            url,
            {"request_id": f"{tag}-s", "token_ids": PROMPT, "stream": True, "sampling_params": long},
            started,
        )
    )
    ns = asyncio.create_task(
        call(
            session,
            "POST",
            url + "/inference/v1/generate",
            {"request_id": f"{tag}-n", "token_ids": PROMPT, "sampling_params": long},
        )
    )
    await started.wait()
    ids = [f"generate-tokens-{tag}-s", f"generate-tokens-{tag}-n"]
    r = await call(session, "POST", url + "/inference/v1/abort_requests", {"request_ids": ids})
    assert (r.status, r.raw) == (200, b"")
    return (await ns).json, await st


async def test_abort_like_live(vllm_dense_url: str) -> None:
    async with _both(vllm_dense_url, token_delay_s=0.002, eos_probability=0.0) as both:
        sim_body, sim_events = await _abort_scenario(both.session, both.sim.url, "ab-sim")
        live_body, live_events = await _abort_scenario(both.session, both.live, "ab-live")
        assert_same_shape(live_body, sim_body)
        for body in (sim_body, live_body):
            ch = body["choices"][0]
            assert ch["finish_reason"] == "abort" and ch["stop_reason"] is None
            assert len(ch["logprobs"]["content"]) == len(ch["token_ids"])
            assert ch["weight_versions"] == [
                {"version": ch["weight_versions"][0]["version"], "start": 0, "end": len(ch["token_ids"])}
            ]
        for events in (sim_events, live_events):
            assert events[-1] == "[DONE]"
            final = events[-2]["choices"][0]
            assert final["finish_reason"] == "abort"
            streamed = sum(len(e["choices"][0]["token_ids"]) for e in events[:-1])
            assert final["weight_versions"][-1]["end"] == streamed
        assert_same_shape(live_events[-2], sim_events[-2])


async def _keep_scenario(session: aiohttp.ClientSession, url: str, tag: str) -> tuple[Any, Any]:
    started = asyncio.Event()
    sp = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
    await call(session, "POST", url + "/update_weight_version", {"new_version": "v1"})
    st = asyncio.create_task(
        _stream_until(
            session,
            url,
            {"request_id": f"{tag}-s", "token_ids": PROMPT, "stream": True, "sampling_params": sp},
            started,
        )
    )
    await started.wait()
    assert (await call(session, "POST", url + "/pause?mode=keep")).json == {"status": "paused"}
    held = asyncio.create_task(
        call(
            session,
            "POST",
            url + "/inference/v1/generate",
            {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}},
        )
    )
    await call(session, "POST", url + "/update_weight_version", {"new_version": "v2"})
    assert (await call(session, "GET", url + "/is_paused")).json == {"is_paused": True}
    assert not held.done()
    assert (await call(session, "POST", url + "/resume")).json == {"status": "resumed"}
    events = await st
    await call(session, "POST", url + "/update_weight_version", {"new_version": "default"})
    return events[-2], (await held).json


async def test_keep_pause_and_version_split_like_live(vllm_dense_url: str) -> None:
    async with _both(vllm_dense_url, token_delay_s=0.002, eos_probability=0.0) as both:
        sim_final, sim_held = await _keep_scenario(both.session, both.sim.url, "k-sim")
        live_final, live_held = await _keep_scenario(both.session, both.live, "k-live")
        assert_same_shape(live_final, sim_final)
        assert_same_shape(live_held, sim_held)
        for final, held in ((sim_final, sim_held), (live_final, live_held)):
            spans = final["choices"][0]["weight_versions"]
            assert [s["version"] for s in spans] == ["v1", "v2"]
            assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 400
            assert held["choices"][0]["weight_versions"] == [{"version": "v2", "start": 0, "end": 4}]
