"""The SGLang personality's control surface over real HTTP: abort by rid (prefix-matched) and
``abort_all``, the three pause modes and continue, weight-version updates, cache flush, duplicate
rids and discovery (``docs/sglang-http-api.md`` §4 to §6).

Synchronisation is by engine state (``wait_for_tokens``, ``wait_for_held``), never by sleeping.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from rollout_grpc.sim import SimEngine
from tests.support.sglang_http import body, generate, sglang_engine
from tests.support.sim_http import Reply, get, post

SLOW: dict[str, Any] = {"token_delay_s": 0.002, "eos_probability": 0.0}
ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def _start(session: aiohttp.ClientSession, eng: SimEngine, payload: dict[str, Any]) -> asyncio.Task[Reply]:
    return asyncio.create_task(generate(session, eng.url, payload))


def _final(r: Reply) -> dict[str, Any]:
    """The last output object of a stream (or the body of a non-streaming answer)."""
    assert r.status == 200
    if r.content_type and r.content_type.startswith("text/event-stream"):
        events = r.events
        assert events[-1] == "[DONE]"
        out: dict[str, Any] = events[-2]
        return out
    body_: dict[str, Any] = r.json
    return body_


def _assert_partial(out: dict[str, Any], at_least: int) -> int:
    m = out["meta_info"]
    n = len(out["output_ids"])
    assert n >= at_least
    assert m["completion_tokens"] == n == len(m["output_token_logprobs"]) == m["output_token_logprobs_length"]
    assert [t[1] for t in m["output_token_logprobs"]] == out["output_ids"]
    return n


@pytest.mark.parametrize("stream", [True, False])
async def test_abort_by_rid_ends_with_the_tokens_so_far(session: aiohttp.ClientSession, stream: bool) -> None:
    async with sglang_engine(**SLOW) as eng:
        task = _start(session, eng, body("victim", 4000, stream=stream))
        await eng.core.wait_for_tokens("victim", 3)
        r = await post(session, eng.url + "/abort_request", {"rid": "victim"})
        assert (r.status, r.raw) == (200, b"")
        out = _final(await task)
    assert out["meta_info"]["finish_reason"] == ABORT
    n = _assert_partial(out, 3)
    assert out["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": n}]


async def test_abort_matches_rid_prefixes_but_needs_the_exact_rid_in_flight(
    session: aiohttp.ClientSession,
) -> None:
    async with sglang_engine(**SLOW) as eng:
        tasks = {
            rid: _start(session, eng, body(rid, 4000, stream=True)) for rid in ("job-1", "job-10", "job-2")
        }
        for rid in tasks:
            await eng.core.wait_for_tokens(rid, 2)
        await post(session, eng.url + "/abort_request", {"rid": "job"})  # no request is called "job"
        await post(session, eng.url + "/abort_request", {"rid": "job-1"})
        one, ten = await tasks["job-1"], await tasks["job-10"]
        assert not tasks["job-2"].done() and eng.core.find("job-2") is not None
        r = await post(session, eng.url + "/abort_request", {"abort_all": True})
        assert (r.status, r.raw) == (200, b"")
        two = await tasks["job-2"]
    for reply in (one, ten, two):
        assert _final(reply)["meta_info"]["finish_reason"]["type"] == "abort"


async def test_abort_all_ends_every_request_with_its_tokens(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(**SLOW) as eng:
        tasks = [_start(session, eng, body(f"r{i}", 4000, stream=i % 2 == 0)) for i in range(4)]
        for i in range(4):
            await eng.core.wait_for_tokens(f"r{i}", 2)
        await post(session, eng.url + "/abort_request", {"abort_all": True})
        outs = [_final(t) for t in await asyncio.gather(*tasks)]
    for out in outs:
        assert out["meta_info"]["finish_reason"] == ABORT
        _assert_partial(out, 2)


async def test_abort_of_an_unknown_rid_is_a_silent_no_op(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(**SLOW) as eng:
        r = await post(session, eng.url + "/abort_request", {"rid": "nobody"})
        empty = await post(session, eng.url + "/abort_request", {})
    assert (r.status, r.raw) == (200, b"") and (empty.status, empty.raw) == (200, b"")


async def test_duplicate_in_flight_rid_is_rejected(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(**SLOW) as eng:
        task = _start(session, eng, body("dup", 4000))
        await eng.core.wait_for_tokens("dup", 1)
        r = await generate(session, eng.url, body("dup", 2))
        await post(session, eng.url + "/abort_request", {"rid": "dup"})
        await task
    assert r.status == 400 and r.json == {"error": {"message": "Duplicate request ID detected: dup"}}


# ---------------------------------------------------------------------------- pause / continue


async def test_pause_abort_returns_after_in_flight_requests_ended_and_holds_new_ones(
    session: aiohttp.ClientSession,
) -> None:
    async with sglang_engine(**SLOW) as eng:
        task = _start(session, eng, body("a", 4000, stream=True))
        await eng.core.wait_for_tokens("a", 3)
        r = await post(session, eng.url + "/pause_generation", {"mode": "abort"})
        assert r.status == 200 and r.json == {"message": "Generation paused successfully.", "status": "ok"}
        assert eng.core.find("a") is None  # ended before the pause call returned
        held = _start(session, eng, body("b", 5))
        await eng.wait_for_held(1)
        loads = (await get(session, eng.url + "/v1/loads")).json
        assert list(loads) == ["timestamp", "version", "accelerator", "num_accelerators", "loads"]
        assert (loads["loads"][0]["num_running_reqs"], loads["loads"][0]["num_waiting_reqs"]) == (0, 1)
        await post(session, eng.url + "/abort_request", {"abort_all": True})  # held: not reached
        c = await post(session, eng.url + "/continue_generation", {})
        assert c.json == {"message": "Generation continued successfully.", "status": "ok"}
        later = _final(await held)
        aborted = _final(await task)
    assert aborted["meta_info"]["finish_reason"] == ABORT
    _assert_partial(aborted, 3)
    assert later["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def test_pause_default_mode_is_abort(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(**SLOW) as eng:
        task = _start(session, eng, body("a", 4000))
        await eng.core.wait_for_tokens("a", 2)
        r = await post(session, eng.url + "/pause_generation", {})
        out = _final(await task)
        await post(session, eng.url + "/continue_generation", {})
    assert r.status == 200 and out["meta_info"]["finish_reason"] == ABORT


@pytest.mark.parametrize(
    "path", ["/pause_generation", "/continue_generation", "/abort_request", "/update_weight_version"]
)
async def test_control_routes_need_a_json_body(session: aiohttp.ClientSession, path: str) -> None:
    async with sglang_engine() as eng:
        r = await post(session, eng.url + path)
        assert not eng.core.paused
    assert r.status == 400 and r.json["object"] == "error" and r.json["type"] == "Bad Request"


@pytest.mark.parametrize(("mode", "retractions", "flush_status"), [("in_place", 0, 400), ("retract", 1, 200)])
async def test_pause_keeps_requests_open_and_continue_resumes_them(
    session: aiohttp.ClientSession, mode: str, retractions: int, flush_status: int
) -> None:
    async with sglang_engine(**SLOW) as eng:
        ref = (await generate(session, eng.url, body("ref", 40))).json
        task = _start(session, eng, body("a", 40, stream=True))
        req = await eng.core.wait_for_tokens("a", 3)
        r = await post(session, eng.url + "/pause_generation", {"mode": mode})
        assert r.status == 200
        frozen_at = req.n_out
        held = _start(session, eng, body("b", 3))
        await eng.wait_for_held(1)
        flush = await post(session, eng.url + "/flush_cache")
        assert flush.status == flush_status
        assert req.n_out == frozen_at and not task.done()  # no token while paused
        await post(session, eng.url + "/continue_generation", {"torch_empty_cache": False})
        out = _final(await task)
        later = _final(await held)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert out["output_ids"] == ref["output_ids"]  # resumed exactly where it stopped
    assert out["meta_info"]["num_retractions"] == retractions
    assert later["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_with_an_unknown_mode_names_the_field(session: aiohttp.ClientSession) -> None:
    async with sglang_engine() as eng:
        r = await post(session, eng.url + "/pause_generation", {"mode": "wait"})
        assert not eng.core.paused
    assert r.status == 400 and "body.mode" in r.json["message"] and r.json["type"] == "Bad Request"


async def test_flush_cache_when_idle(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        await generate(session, eng.url, body("a", 2))
        r = await post(session, eng.url + "/flush_cache")
        again = (await generate(session, eng.url, body("b", 2))).json
    assert r.status == 200 and r.raw.startswith(b"Cache flushed.")
    assert again["meta_info"]["cached_tokens"] == 0


# ---------------------------------------------------------------------------- weight version


async def test_update_weight_version_aborts_in_flight_requests_by_default(
    session: aiohttp.ClientSession,
) -> None:
    async with sglang_engine(**SLOW) as eng:
        task = _start(session, eng, body("a", 4000, stream=True))
        await eng.core.wait_for_tokens("a", 3)
        r = await post(session, eng.url + "/update_weight_version", {"new_version": "v2"})
        aborted = _final(await task)
        after = (await generate(session, eng.url, body("b", 2))).json
        info = (await get(session, eng.url + "/get_model_info")).json
    assert r.status == 200
    assert r.json == {"success": True, "message": "Weight version updated to v2", "new_version": "v2"}
    assert aborted["meta_info"]["finish_reason"] == ABORT
    n = len(aborted["output_ids"])
    assert aborted["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": n}]
    assert after["meta_info"]["weight_version"] == "v2" and info["weight_version"] == "v2"


async def test_update_weight_version_without_abort_splits_the_spans(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(**SLOW) as eng:
        task = _start(session, eng, body("a", 40, stream=True))
        await eng.core.wait_for_tokens("a", 5)
        await post(session, eng.url + "/pause_generation", {"mode": "in_place"})
        req = eng.core.find("a")
        assert req is not None
        k = req.n_out
        r = await post(
            session, eng.url + "/update_weight_version", {"new_version": "v3", "abort_all_requests": False}
        )
        await post(session, eng.url + "/continue_generation", {})
        out = _final(await task)
    assert r.status == 200
    m = out["meta_info"]
    assert m["finish_reason"]["type"] == "length"
    assert m["weight_versions"] == [
        {"version": "default", "start": 0, "end": k},
        {"version": "v3", "start": k, "end": 40},
    ]
    assert m["weight_version"] == "v3"


async def test_update_weight_version_requires_new_version(session: aiohttp.ClientSession) -> None:
    async with sglang_engine() as eng:
        r = await post(session, eng.url + "/update_weight_version", {"abort_all_requests": False})
    assert r.status == 400 and "body.new_version" in r.json["message"]


async def test_initial_weight_version_is_configurable(session: aiohttp.ClientSession) -> None:
    from rollout_grpc.sim.config import SGLangOptions

    async with sglang_engine(SGLangOptions(weight_version="step-7"), eos_probability=0.0) as eng:
        out = (await generate(session, eng.url, body("a", 2))).json
    assert out["meta_info"]["weight_version"] == "step-7"


# ---------------------------------------------------------------------------- discovery


async def test_health_model_and_server_info(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(multimodal=True) as eng:
        health = [await get(session, eng.url + p) for p in ("/health", "/health_generate")]
        old, new = (
            (await get(session, eng.url + "/get_model_info")).json,
            (await get(session, eng.url + "/model_info")).json,
        )
        s_old, s_new = (
            (await get(session, eng.url + "/get_server_info")).json,
            (await get(session, eng.url + "/server_info")).json,
        )
        models = (await get(session, eng.url + "/v1/models")).json
        eng.set_dead()
        dead = await get(session, eng.url + "/health_generate")
        missing = await get(session, eng.url + "/inference/v1/generate")
        # Routes of older builds that 0.5.23 no longer has (docs/sglang-http-api.md §6).
        old_routes = ("/get_weight_version", "/weight_version", "/get_load")
        gone = [await get(session, eng.url + p) for p in old_routes]
    assert [(h.status, h.raw) for h in health] == [(200, b""), (200, b"")]
    assert old == new
    assert list(old)[:5] == [  # 0.5.23 entrypoints/http_server.py 815-825
        "model_path",
        "served_model_name",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
    ]
    assert old["has_image_understanding"] is True
    assert s_old == s_new
    for key in (
        "context_length",
        "enable_return_routed_experts",
        "incremental_streaming_output",
        "weight_version",
    ):
        assert key in s_old
    assert s_old["internal_states"] and s_old["version"]
    assert models["data"][0]["max_model_len"] == eng.config.max_model_len
    assert dead.status == 503
    assert (missing.status, missing.json) == (404, {"detail": "Not Found"})
    assert [(g.status, g.json) for g in gone] == [(404, {"detail": "Not Found"})] * 3
