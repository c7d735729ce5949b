"""Fault switches (from Python and over ``/_sim/faults``) and the admin routes."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson
import pytest

from rollout_grpc.sim import PERSISTENT, SimEngine
from tests.support.sim_http import PROMPT, EngineFactory, generate, get, post

INTERNAL = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
}


def _body(rid: str = "f", max_tokens: int = 8, stream: bool = False, **sp: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "token_ids": PROMPT,
        "stream": stream,
        "sampling_params": {"max_tokens": max_tokens, **sp},
    }


async def test_http_500_one_shot_and_persistent(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    engine.faults.http_500 = 1
    r = await generate(session, engine.url, _body())
    assert (r.status, r.json) == (500, INTERNAL)
    assert (await generate(session, engine.url, _body())).status == 200
    assert engine.stats.generate_requests == 2 and engine.stats.generate_started == 1
    r = await post(session, engine.url + "/_sim/faults", {"http_500": PERSISTENT})
    assert r.json["http_500"] == -1
    for _ in range(3):
        assert (await generate(session, engine.url, _body())).status == 500
    await post(session, engine.url + "/_sim/faults", {"reset": True})
    assert (await generate(session, engine.url, _body())).status == 200


async def test_mid_stream_error(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    engine.faults.stream_error = 1
    engine.faults.stream_error_after = 3
    r = await generate(session, engine.url, _body(stream=True, max_tokens=10))
    assert r.status == 200
    events = r.events
    assert [len(e["choices"][0]["token_ids"]) for e in events[:3]] == [1, 1, 1]
    assert events[3] == INTERNAL
    assert events[4] == "[DONE]" and len(events) == 5
    engine.faults.stream_error = 1
    r = await generate(session, engine.url, _body(max_tokens=10))
    assert (r.status, r.json) == (500, INTERNAL)
    await engine.wait_idle()
    assert engine.stats.aborted == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_drop_connection(engine: SimEngine, session: aiohttp.ClientSession, stream: bool) -> None:
    engine.faults.drop_connection = 1
    engine.faults.drop_after_tokens = 4
    url = engine.url + "/inference/v1/generate"
    received = b""
    with pytest.raises(aiohttp.ClientError):
        async with session.post(url, json=_body(stream=stream, max_tokens=50)) as resp:
            async for chunk in resp.content.iter_any():
                received += chunk
    if stream:
        assert received.count(b"data: ") == 4 and b"[DONE]" not in received
    await engine.wait_idle()
    assert engine.stats.aborted == 1
    assert (await generate(session, engine.url, _body())).status == 200  # one-shot


async def test_hang_never_answers(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    engine.faults.hang = 1
    task = asyncio.create_task(generate(session, engine.url, _body()))
    await engine.core.wait_until(lambda: engine.stats.hung == 1)
    for _ in range(3):  # the engine stays responsive meanwhile
        assert (await generate(session, engine.url, _body())).status == 200
    assert not task.done()
    assert engine.core.load == 1 and not engine.core.requests  # accepted, but not in the engine
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await engine.core.wait_until(lambda: engine.core.load == 0)


async def test_logprob_mismatch(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    engine.faults.logprob_mismatch = 2
    body = (await generate(session, engine.url, _body(max_tokens=6, logprobs=1))).json
    ch = body["choices"][0]
    assert len(ch["token_ids"]) == 6 and len(ch["logprobs"]["content"]) == 5
    events = (await generate(session, engine.url, _body(stream=True, max_tokens=6, logprobs=1))).events
    n_tok = sum(len(e["choices"][0]["token_ids"]) for e in events[:-1])
    n_lp = sum(len(e["choices"][0]["logprobs"]["content"]) for e in events[:-1])
    assert (n_tok, n_lp) == (6, 5)
    body = (await generate(session, engine.url, _body(max_tokens=6, logprobs=1))).json
    assert len(body["choices"][0]["logprobs"]["content"]) == 6


async def test_dead_engine(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    engine.set_dead(True)
    assert (await get(session, engine.url + "/health")).status == 503
    r = await generate(session, engine.url, _body())
    assert r.status == 500 and r.json["error"]["type"] == "InternalServerError"
    engine.set_dead(False)
    assert (await get(session, engine.url + "/health")).status == 200
    await post(session, engine.url + "/_sim/faults", {"dead": True})
    assert (await get(session, engine.url + "/health")).status == 503
    assert engine.faults.dead


async def test_admin_routes(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(token_delay_s=0.002, eos_probability=0.0) as eng:
        r = await post(session, eng.url + "/_sim/faults", {"nope": 1})
        assert r.status == 400
        assert (await get(session, eng.url + "/_sim/faults")).json == eng.faults.to_dict()
        task = asyncio.create_task(generate(session, eng.url, _body("w", max_tokens=500)))
        r = await post(session, eng.url + "/_sim/wait", {"request_id": "generate-tokens-w", "tokens": 10})
        assert r.json == {"ok": True}
        stats = (await get(session, eng.url + "/_sim/stats")).json
        assert stats["in_flight"] == 1 and stats["running"] == 1
        assert stats["engine_request_ids"] == ["generate-tokens-w"]
        assert stats["last_requests"][0]["request_id"] == "w"
        await post(session, eng.url + "/abort_requests", {})
        assert (await task).json["choices"][0]["finish_reason"] == "abort"
        assert (await post(session, eng.url + "/_sim/wait", {"idle": True})).json == {"ok": True}
        r = await post(session, eng.url + "/_sim/wait", {"running": 1, "timeout_s": 0.01})
        assert r.status == 408
        r = await post(session, eng.url + "/_sim/config", {"eos_probability": 1.0, "token_delay_s": 0})
        assert r.json["eos_probability"] == 1.0
        ch = (await generate(session, eng.url, _body(max_tokens=50, temperature=0))).json["choices"][0]
        assert (ch["token_ids"], ch["finish_reason"], ch["stop_reason"]) == ([2], "stop", None)
        stats = (await post(session, eng.url + "/_sim/stats/reset")).json
        assert stats["generate_requests"] == 0


def _lacks_logprob(data: bytes) -> bool:
    content = (orjson.loads(data)["choices"][0].get("logprobs") or {}).get("content") or []
    return bool(content) and all("logprob" not in e for e in content)


def _data_lines(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize(
    ("kind", "broken"),
    [
        ("invalid_json", lambda d: d.startswith(b"{") and not d.endswith(b"}")),
        ("array_chunk", lambda d: d.startswith(b"[") and d != b"[DONE]"),
        ("missing_logprob", lambda d: d.startswith(b'{"') and _lacks_logprob(d)),
        ("string_token_ids", lambda d: b'"token_ids":["' in d),
        ("negative_token_ids", lambda d: b'"token_ids":[-' in d),
        ("huge_line", lambda d: len(d) > 1 << 20),
        ("bad_weight_spans", lambda d: b'"start":"0"' in d),
    ],
)
async def test_malformed_kinds(
    engine: SimEngine, session: aiohttp.ClientSession, kind: str, broken: Any
) -> None:
    engine.faults.update({"malformed": 1, "malformed_kind": kind, "malformed_after": 2})
    r = await generate(session, engine.url, _body(stream=True, max_tokens=6, logprobs=0, ignore_eos=True))
    lines = _data_lines(r.raw)
    hits = [i for i, d in enumerate(lines) if broken(d)]
    assert len(hits) == 1, (kind, lines)
    if kind != "bad_weight_spans":
        assert hits[0] == 2  # the first chunk after 2 tokens
    assert lines[-1] == b"[DONE]"
    r = await generate(session, engine.url, _body(stream=True, max_tokens=6, logprobs=0, ignore_eos=True))
    assert not any(broken(d) for d in _data_lines(r.raw)), "one-shot"


async def test_unknown_malformed_kind_is_refused(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    r = await post(session, engine.url + "/_sim/faults", {"malformed_kind": "nope"})
    assert r.status == 400


async def test_request_500_seed_fails_only_that_request(
    engine: SimEngine, session: aiohttp.ClientSession
) -> None:
    engine.faults.request_500_seed = 77
    for _ in range(2):
        r = await generate(session, engine.url, _body(seed=77))
        assert (r.status, r.json) == (500, INTERNAL)
    assert (await generate(session, engine.url, _body(seed=78))).status == 200
    assert (await get(session, engine.url + "/health")).status == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": [*PROMPT, 999999]}, None),
        ({"sampling_params": {"max_tokens": 1, "stop_token_ids": [999999]}}, "stop_token_ids"),
        ({"sampling_params": {"max_tokens": 1, "logit_bias": {"999999": 1}}}, "logit_bias"),
        ({"token_ids": [5] * 5000}, None),
    ],
)
async def test_engine_side_input_errors_come_inside_the_stream(
    engine: SimEngine, session: aiohttp.ClientSession, body: dict[str, Any], param: str | None
) -> None:
    """vLLM 0.32: HTTP 200, one error event in json.dumps spacing, then [DONE] (400 when not streaming)."""
    request = {**_body(max_tokens=1), **body}
    plain = await generate(session, engine.url, request)
    assert plain.status == 400 and plain.json["error"]["param"] == param
    r = await generate(session, engine.url, {**request, "stream": True})
    assert r.status == 200
    error, done = _data_lines(r.raw)
    assert error.startswith(b'{"error": {"message": ') and done == b"[DONE]"
    assert orjson.loads(error) == plain.json


async def test_the_package_serves_no_test_routes(session: aiohttp.ClientSession) -> None:
    """`/_sim/*` is mounted by the tests (tests/support/sim_admin.py); a plain engine is vLLM's surface."""
    async with SimEngine() as plain:
        r = await get(session, plain.url + "/_sim/faults")
        assert (r.status, r.json) == (404, {"detail": "Not Found"})
