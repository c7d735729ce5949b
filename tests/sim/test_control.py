"""Abort, pause/resume, weight versions and lifecycle, against ``r_pause.json`` where recorded.

Synchronisation is by engine state (``wait_for_tokens``, ``wait_for_held``, ``wait_idle``), never
by sleeping; assertions are about outcomes, never durations.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from rollout_grpc.sim import SimEngine
from tests.support.conformance import assert_same_shape, shape_of
from tests.support.sim_http import PROMPT, EngineFactory, Reply, generate, get, golden, post

PAUSE = golden("r_pause")
TRIM = ("$.choices[].token_ids", "$.choices[].logprobs")
SLOW = {"token_delay_s": 0.002, "eos_probability": 0.0, "max_model_len": 4096}


def _body(rid: str, max_tokens: int = 4000, stream: bool = False, **sp: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "token_ids": PROMPT,
        "stream": stream,
        "sampling_params": {"max_tokens": max_tokens, "logprobs": 0 if not stream else None, **sp},
    }


def _start(session: aiohttp.ClientSession, eng: SimEngine, body: dict[str, Any]) -> asyncio.Task[Reply]:
    return asyncio.create_task(generate(session, eng.url, body))


def _check_nonstream_abort(r: Reply, rec: dict[str, Any]) -> int:
    assert r.status == 200
    body = r.json
    assert_same_shape(rec["body_trimmed"], body, trimmed=TRIM)
    ch = body["choices"][0]
    n = len(ch["token_ids"])
    assert ch["finish_reason"] == "abort" and ch["stop_reason"] is None
    assert len(ch["logprobs"]["content"]) == n
    assert ch["weight_versions"] == [{"version": "default", "start": 0, "end": n}]
    assert body["usage"]["completion_tokens"] == n
    return n


def _check_stream_abort(r: Reply, rec: dict[str, Any]) -> None:
    events = r.events
    last_two = events[-3:]
    want = rec["last_chunks"]
    assert [shape_of(e) for e in last_two[:1]] == [shape_of(want[0])]
    final = last_two[1]
    assert_same_shape(want[1], final)
    assert final["choices"][0]["finish_reason"] == "abort"
    assert final["choices"][0]["token_ids"] == []
    streamed = sum(len(e["choices"][0]["token_ids"]) for e in events[:-1])
    assert final["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": streamed}]
    assert last_two[2] == "[DONE]"


async def test_scaleout_abort_needs_prefixed_ids(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    rec_raw = PAUSE["abort"]["scaleout_raw_id"]
    rec = PAUSE["abort"]["scaleout_prefixed_id"]
    async with make_engine(**SLOW) as eng:
        ns = _start(session, eng, _body("ab-2"))
        st = _start(session, eng, _body("ab-2-s", stream=True))
        await eng.wait_for_tokens("generate-tokens-ab-2", 20)
        await eng.wait_for_tokens("generate-tokens-ab-2-s", 20)
        raw = await post(
            session, eng.url + "/inference/v1/abort_requests", {"request_ids": ["ab-2", "ab-2-s"]}
        )
        assert (raw.status, raw.raw, raw.content_type) == (200, b"", rec_raw["abort_response"]["headers_ct"])
        # the raw ids matched nothing: both keep producing tokens
        await eng.wait_for_tokens("generate-tokens-ab-2", 40)
        await eng.wait_for_tokens("generate-tokens-ab-2-s", 40)
        assert not ns.done() and not st.done()
        ids = rec["request_ids"]
        r = await post(session, eng.url + "/inference/v1/abort_requests", {"request_ids": ids})
        assert (r.status, r.raw, r.content_type) == (200, b"", rec["abort_response"]["headers_ct"])
        n = _check_nonstream_abort(await ns, rec["nonstream_client_got"])
        assert n >= 40
        _check_stream_abort(await st, rec["stream_client_got"])
        assert eng.stats.aborted == 2


async def test_raw_id_abort_runs_to_length(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    async with make_engine(**SLOW) as eng:
        ns = _start(session, eng, _body("ab-1", max_tokens=60))
        await eng.wait_for_tokens("generate-tokens-ab-1", 5)
        await post(session, eng.url + "/inference/v1/abort_requests", {"request_ids": ["ab-1"]})
        body = (await ns).json
        assert body["choices"][0]["finish_reason"] == "length"
        assert len(body["choices"][0]["token_ids"]) == 60


async def test_abort_body_errors(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = PAUSE["abort"]["scaleout_missing_ids"]
    r = await post(session, engine.url + "/inference/v1/abort_requests", {})
    assert (r.status, r.json) == (rec["status"], rec["body"])
    r = await post(session, engine.url + "/inference/v1/abort_requests", data=b"")
    assert r.json["error"]["message"] == "JSON decode error: Expecting value: line 1 column 1 (char 0)"
    # the dev router: a zero-length body is not JSON; {} aborts everything
    r = await post(session, engine.url + "/abort_requests", data=b"")
    assert (r.status, r.json["error"]["message"]) == (400, "Invalid JSON format")
    r = await post(session, engine.url + "/abort_requests", [1])
    assert (r.status, r.json["error"]["message"]) == (400, "Request body must be a JSON object")
    r = await post(session, engine.url + "/abort_requests", {})
    assert r.json == {"status": "aborted", "aborted": 0}


async def test_dev_abort_by_ids_and_all(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    rec = PAUSE["abort"]["dev_prefixed_id"]
    async with make_engine(**SLOW) as eng:
        ns = _start(session, eng, _body("ab-3"))
        st = _start(session, eng, _body("ab-3-s", stream=True))
        await eng.wait_for_tokens("generate-tokens-ab-3", 10)
        await eng.wait_for_tokens("generate-tokens-ab-3-s", 10)
        r = await post(session, eng.url + "/abort_requests", {"request_ids": rec["request_ids"]})
        assert (r.json, r.content_type) == (
            rec["abort_response"]["body"],
            rec["abort_response"]["headers_ct"],
        )
        _check_nonstream_abort(await ns, rec["nonstream_client_got"])
        _check_stream_abort(await st, rec["stream_client_got"])

        rec_all = PAUSE["abort"]["dev_abort_all_empty_body"]
        a = _start(session, eng, _body("ab-all-1"))
        b = _start(session, eng, _body("ab-all-2", stream=True))
        await eng.wait_for_tokens("generate-tokens-ab-all-1", 5)
        await eng.wait_for_tokens("generate-tokens-ab-all-2", 5)
        r = await post(session, eng.url + "/abort_requests", {})
        assert r.json == rec_all["abort_response"]["body"]
        _check_nonstream_abort(await a, rec_all["nonstream_client_got"])
        _check_stream_abort(await b, rec_all["stream_client_got"])
        assert (await get(session, eng.url + "/is_paused")).json == {"is_paused": False}
        # counting semantics: the ids sent, found or not
        r = await post(session, eng.url + "/abort_requests", {"request_ids": ["nope-1", "nope-2", "nope-3"]})
        assert r.json == {"status": "aborted", "aborted": 3}


async def test_pause_abort_holds_new_requests(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    rec = PAUSE["pause"]["mode_abort"]
    async with make_engine(**SLOW) as eng:
        ns = _start(session, eng, _body("pause-abort-ns"))
        st = _start(session, eng, _body("pause-abort-st", stream=True))
        await eng.wait_for_tokens("generate-tokens-pause-abort-ns", 10)
        await eng.wait_for_tokens("generate-tokens-pause-abort-st", 10)
        r = await post(session, eng.url + "/pause?mode=abort")
        assert (r.status, r.json) == (200, rec["pause_response"]["body"])
        # pause(abort) returns after the in-flight requests have left the engine
        assert eng.core.find("generate-tokens-pause-abort-ns") is None
        assert eng.core.find("generate-tokens-pause-abort-st") is None
        _check_nonstream_abort(await ns, rec["nonstream_client_got"])
        _check_stream_abort(await st, rec["stream_client_got"])
        assert (await get(session, eng.url + "/is_paused")).json == rec["is_paused_after_pause"]
        new = _start(session, eng, _body("pause-abort-new", max_tokens=4))
        await eng.wait_for_held(1)
        assert not new.done()
        assert (await post(session, eng.url + "/resume")).json == rec["resume_response"]["body"]
        got = await new
        want = rec["request_submitted_while_paused"]
        assert_same_shape(want["body_trimmed"], got.json, trimmed=TRIM)
        assert got.json["choices"][0]["finish_reason"] == "length"
        assert got.json["usage"] == want["usage"]


async def test_pause_keep_freezes_and_continues(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    rec = PAUSE["pause"]["mode_keep"]
    async with make_engine(**SLOW) as eng:
        ns = _start(session, eng, _body("pause-keep-ns", max_tokens=300))
        st = _start(session, eng, _body("pause-keep-st", max_tokens=300, stream=True))
        await eng.wait_for_tokens("generate-tokens-pause-keep-ns", 10)
        await eng.wait_for_tokens("generate-tokens-pause-keep-st", 10)
        r = await post(session, eng.url + "/pause?mode=keep")
        assert r.json == rec["pause_response"]["body"]
        req = eng.core.find("generate-tokens-pause-keep-ns")
        assert req is not None
        frozen_at = req.n_out
        new = _start(session, eng, _body("pause-keep-new", max_tokens=4))
        await eng.wait_for_held(1)
        for _ in range(5):  # plenty of event-loop turns: no token may appear while frozen
            assert (await get(session, eng.url + "/is_paused")).json == {"is_paused": True}
        assert req.n_out == frozen_at
        assert not ns.done() and not st.done() and not new.done()
        # frozen requests still count as running (vLLM reports them as running)
        assert len(eng.core.running) == 2
        await post(session, eng.url + "/resume")
        body = (await ns).json
        assert_same_shape(rec["nonstream_client_got"]["body_trimmed"], body, trimmed=TRIM)
        assert body["choices"][0]["finish_reason"] == "length"
        assert len(body["choices"][0]["token_ids"]) == 300
        events = (await st).events
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 300
        assert (await new).json["choices"][0]["finish_reason"] == "length"


async def test_pause_keep_output_equals_uninterrupted(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    """Freezing changes nothing about the tokens: seeded output is identical to an unpaused run."""
    async with make_engine(**SLOW) as eng:
        ref = (await generate(session, eng.url, _body("ref", max_tokens=80, seed=5))).json
        task = _start(session, eng, _body("frozen", max_tokens=80, seed=5))
        await eng.wait_for_tokens("generate-tokens-frozen", 20)
        await post(session, eng.url + "/pause?mode=keep")
        await post(session, eng.url + "/resume")
        got = (await task).json
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]


async def test_pause_wait_returns_when_drained(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    rec = PAUSE["pause"]["mode_wait"]
    async with make_engine(**SLOW) as eng:
        ns = _start(session, eng, _body("pause-wait-ns", max_tokens=120))
        await eng.wait_for_tokens("generate-tokens-pause-wait-ns", 5)
        pause = asyncio.create_task(post(session, eng.url + "/pause?mode=wait"))
        await eng.core.wait_until(lambda: eng.core.paused)
        new = _start(session, eng, _body("pause-wait-new", max_tokens=4))
        await eng.wait_for_held(1)
        r = await pause
        assert r.json == rec["pause_response"]["body"]
        # the pause call came back only after the request drained
        assert eng.core.find("generate-tokens-pause-wait-ns") is None
        body = (await ns).json
        assert body["choices"][0]["finish_reason"] == "length"
        assert len(body["choices"][0]["token_ids"]) == 120
        assert not new.done()
        await post(session, eng.url + "/resume")
        assert (await new).json["choices"][0]["finish_reason"] == "length"


async def test_pause_resume_idempotent(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = PAUSE["pause"]["idempotence"]
    assert (await post(session, engine.url + "/pause?mode=keep&clear_cache=false")).json == rec[
        "pause_clear_cache_false"
    ]
    assert (await post(session, engine.url + "/pause?mode=keep")).json == rec["pause_again"]
    assert (await post(session, engine.url + "/resume")).json == rec["resume"]
    assert (await post(session, engine.url + "/resume")).json == rec["resume_again"]
    assert (await get(session, engine.url + "/is_paused")).json == rec["is_paused"]


async def test_weight_version_split_during_keep_pause(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    rec = PAUSE["weightsync"]["keep_then_version_bump"]
    async with make_engine(**SLOW) as eng:
        await post(session, eng.url + "/update_weight_version", {"new_version": "v1"})
        ns = _start(session, eng, _body("ws-ns", max_tokens=200))
        st = _start(session, eng, _body("ws-st", max_tokens=200, stream=True))
        await eng.wait_for_tokens("generate-tokens-ws-ns", 15)
        await eng.wait_for_tokens("generate-tokens-ws-st", 15)
        assert (await post(session, eng.url + "/pause?mode=keep")).json == rec["pause"]
        split_ns = eng.core.find("generate-tokens-ws-ns").n_out  # type: ignore[union-attr]
        split_st = eng.core.find("generate-tokens-ws-st").n_out  # type: ignore[union-attr]
        assert (await post(session, eng.url + "/update_weight_version", {"new_version": "v2"})).json == rec[
            "update"
        ]
        assert (await post(session, eng.url + "/resume")).json == rec["resume"]
        body = (await ns).json
        assert body["choices"][0]["weight_versions"] == [
            {"version": "v1", "start": 0, "end": split_ns},
            {"version": "v2", "start": split_ns, "end": 200},
        ]
        final = (await st).events[-2]
        assert_same_shape(rec["stream_final_chunk"], final)
        assert final["choices"][0]["weight_versions"] == [
            {"version": "v1", "start": 0, "end": split_st},
            {"version": "v2", "start": split_st, "end": 200},
        ]


async def test_logprobs_sampled_token_first(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = PAUSE["weightsync"]["logprobs3_sampled_temp1.5"]
    r = await generate(session, engine.url, rec["request"])
    content = r.json["choices"][0]["logprobs"]
    assert_same_shape(rec["logprobs"], content)
    for entry in content["content"]:
        top = entry["top_logprobs"]
        assert len(top) == 3
        assert top[0] == {"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": entry["rank"]}
        others = [t["rank"] for t in top[1:]]
        assert others == sorted(others) and entry["rank"] not in others
        want_ranks = [r for r in (1, 2, 3) if r != entry["rank"]][:2]
        assert others == want_ranks


async def test_logprob_token_ids_alone_gives_null(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = PAUSE["weightsync"]["logprob_token_ids"]
    r = await generate(session, engine.url, rec["request"])
    assert r.status == 200
    assert_same_shape(rec["body"], r.json)
    rec2 = PAUSE["weightsync"]["prompt_logprob_token_ids"]
    r = await generate(session, engine.url, rec2["request"])
    assert (r.status, r.json) == (rec2["status"], rec2["body"])


async def test_client_disconnect_aborts(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(**SLOW) as eng:
        for stream in (False, True):
            rid = f"gone-{stream}"
            task = _start(session, eng, _body(rid, stream=stream))
            await eng.wait_for_tokens(f"generate-tokens-{rid}", 5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await eng.wait_idle()
        assert eng.stats.aborted == 2
        assert eng.stats.finish_reasons["abort"] == 2
        running = [ln for ln in (await get(session, eng.url + "/metrics")).raw.decode().splitlines()]
        assert any(ln.startswith("vllm:num_requests_running{") and ln.endswith(" 0.0") for ln in running)


async def test_abort_all_releases_held_requests(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    async with make_engine(**SLOW) as eng:
        await post(session, eng.url + "/pause?mode=keep")
        held = _start(session, eng, _body("held-1", max_tokens=10))
        await eng.wait_for_held(1)
        r = await post(session, eng.url + "/abort_requests", {})
        assert r.json == {"status": "aborted", "aborted": 1}
        body = (await held).json
        ch = body["choices"][0]
        assert (ch["finish_reason"], ch["token_ids"], ch["logprobs"]) == ("abort", [], {"content": []})
        assert ch["weight_versions"] == []  # vLLM's _weight_version_spans with no tokens
        await post(session, eng.url + "/resume")


async def test_load_counts_in_flight(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(**SLOW) as eng:
        tasks = [_start(session, eng, _body(f"load-{i}", max_tokens=2000)) for i in range(3)]
        await eng.wait_for_running(3)
        assert (await get(session, eng.url + "/load")).json == {"server_load": 3}
        await post(session, eng.url + "/abort_requests", {})
        await asyncio.gather(*tasks)
        await eng.wait_idle()
        assert (await get(session, eng.url + "/load")).json == {"server_load": 0}


async def test_gating_switches(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(dev_mode=False) as eng:
        for path in ("/pause", "/resume", "/abort_requests", "/update_weight_version"):
            r = await post(session, eng.url + path, {})
            assert (r.status, r.json) == (404, {"detail": "Not Found"})
        assert (await get(session, eng.url + "/is_paused")).status == 404
        assert (await generate(session, eng.url, _body("ok", max_tokens=1))).status == 200
    async with make_engine(scale_out=False) as eng:
        for path in ("/inference/v1/generate", "/inference/v1/abort_requests", "/v1/chat/completions/render"):
            r = await post(session, eng.url + path, {})
            assert r.status == 403
            assert r.json == {
                "error": {
                    "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
                    "to enable them.",
                    "type": "PermissionDeniedError",
                    "param": None,
                    "code": 403,
                }
            }
        assert eng.stats.generate_requests == 0


async def test_restart_on_same_port(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(**SLOW) as eng:
        port = eng.port
        task = _start(session, eng, _body("dies", max_tokens=4000))
        await eng.wait_for_tokens("generate-tokens-dies", 3)
        await eng.stop()
        assert not eng.running
        with pytest.raises(aiohttp.ClientError):
            await task
        with pytest.raises(aiohttp.ClientError):
            await get(session, eng.url + "/health")
        await eng.start()
        assert eng.port == port
        assert (await get(session, eng.url + "/health")).status == 200
        r = await generate(session, eng.url, _body("again", max_tokens=3))
        assert r.json["choices"][0]["finish_reason"] == "length"


async def test_hundreds_of_concurrent_requests(make_engine: EngineFactory) -> None:
    """One task per request: 300 streams and bodies progress together and all complete."""
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        make_engine(token_delay_s=0.001, eos_probability=0.0) as eng,
        aiohttp.ClientSession(connector=connector) as s,
    ):
        bodies = [_body(f"c{i}", max_tokens=20, stream=i % 2 == 0, seed=i) for i in range(300)]
        replies = await asyncio.gather(*(generate(s, eng.url, b) for b in bodies))
        for i, r in enumerate(replies):
            if i % 2 == 0:
                assert r.events[-2]["choices"][0]["finish_reason"] == "length"
            else:
                assert len(r.json["choices"][0]["token_ids"]) == 20
        assert eng.stats.generate_finished == 300 and eng.stats.generation_tokens_total == 6000
