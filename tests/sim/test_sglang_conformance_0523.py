"""The SGLang simulator's bodies held to SGLang 0.5.23's shapes (``tests/support/sglang_shapes.py``,
each written down from the released wheel with its file and line; SGLang is never imported).

Every route an RL client uses is called over real HTTP: generate outputs (finished, cumulative and
incremental streams, abort, queued-abort echo), control routes, weight routes, discovery and each
error envelope. A simulator body that gains, loses, reorders or retypes a key fails here.
Synchronisation is by engine state (``wait_for_tokens``, ``wait_until``), never by sleeping.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp
import pytest

from rollout_grpc.sim.config import SGLangOptions
from rollout_grpc.sim.sglang.state import SGLANG_KEY
from tests.support import sglang_shapes as S
from tests.support.sglang_http import body, generate, sglang_engine
from tests.support.sim_http import Reply, get, post

SLOW: dict[str, Any] = {"token_delay_s": 0.002, "eos_probability": 0.0}


def output_problems(out: Any, *, incremental: bool = False) -> list[str]:
    """Every difference of one generate output from 0.5.23's shapes, nested parts included."""
    problems = S.OUTPUT.problems(out)
    if problems:
        return problems
    meta = out["meta_info"]
    problems += S.META_INFO.problems(meta)
    fin = meta.get("finish_reason")
    if fin is not None:
        shape = S.FINISH_BY_TYPE.get(str(fin.get("type"))) if isinstance(fin, dict) else None
        problems += shape.problems(fin) if shape else [f"finish_reason of unknown type: {fin!r}"]
        if "e2e_latency" not in meta:
            problems.append(f"finished output without e2e_latency ({S.TM}:2753)")
    elif "e2e_latency" in meta:
        problems.append(f"e2e_latency on an unfinished output ({S.TM}:2750-2753)")
    for span in meta.get("weight_versions", []):
        problems += S.WEIGHT_SPAN.problems(span)
    for triple in meta.get("output_token_logprobs", []):
        problems += S.logprob_triple_problems(triple)
    if "output_token_logprobs" in meta:
        want = len(out["output_ids"]) if incremental else meta["output_token_logprobs_length"]
        if len(meta["output_token_logprobs"]) != want:
            problems.append(
                f"output_token_logprobs has {len(meta['output_token_logprobs'])} rows, want {want}"
            )
        if meta["output_token_logprobs_length"] != meta["completion_tokens"]:
            problems.append(
                "output_token_logprobs_length is cumulative (TM 2870) and equals completion_tokens"
            )
    return problems


def stream_outputs(r: Reply) -> list[dict[str, Any]]:
    assert r.status == 200 and (r.content_type or "").startswith("text/event-stream"), r.raw[:200]
    events = r.events
    assert events[-1] == "[DONE]", f"a stream ends with data: [DONE] ({S.HS}:975)"
    return list(events[:-1])


async def test_a_finished_output_has_the_0523_shape(session: aiohttp.ClientSession) -> None:
    async with sglang_engine() as eng:
        length = await generate(session, eng.url, body(max_new_tokens=4, top_logprobs_num=2))
        stop = await generate(session, eng.url, body(max_new_tokens=64, sp={"stop_token_ids": [206]}))
    assert length.status == stop.status == 200
    assert output_problems(length.json) == []
    assert length.json["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert output_problems(stop.json) == []


@pytest.mark.parametrize("incremental", [False, True])
async def test_every_stream_chunk_has_the_0523_shape(
    session: aiohttp.ClientSession, incremental: bool
) -> None:
    opts = SGLangOptions(incremental_streaming_output=incremental)
    async with sglang_engine(opts, eos_probability=0.0) as eng:
        chunks = stream_outputs(await generate(session, eng.url, body(max_new_tokens=6, stream=True)))
    assert len(chunks) >= 2
    for chunk in chunks:
        assert output_problems(chunk, incremental=incremental) == []
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    ids = [i for c in chunks for i in c["output_ids"]] if incremental else chunks[-1]["output_ids"]
    assert len(ids) == chunks[-1]["meta_info"]["completion_tokens"] == 6
    if not incremental:  # cumulative: each chunk extends the previous one (TM 2649-2660)
        for a, b in itertools.pairwise(chunks):
            assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]


SENT = "response_sent_to_client_ts"


@pytest.mark.parametrize("stream", [False, True])
async def test_every_assembled_output_reports_dp_rank_null(
    session: aiohttp.ClientSession, stream: bool
) -> None:
    """One scheduler, no data-parallel controller: its rank is None and the batch still lists it, so
    ``_handle_batch_output`` writes ``"dp_rank": null`` (TM 2616-2617) before ``e2e_latency``."""
    async with sglang_engine(eos_probability=0.0) as eng:
        reply = await generate(session, eng.url, body(max_new_tokens=4, stream=stream))
    outs = stream_outputs(reply) if stream else [reply.json]
    for out in outs:
        meta = out["meta_info"]
        assert "dp_rank" in meta and meta["dp_rank"] is None, meta
        assert output_problems(out) == []
    assert [k for k in outs[-1]["meta_info"] if k != SENT][-2:] == ["dp_rank", "e2e_latency"]


@pytest.mark.parametrize("mode", ["body", "cumulative", "incremental"])
async def test_only_the_first_output_carries_the_send_time(session: aiohttp.ClientSession, mode: str) -> None:
    """``response_sent_to_client_ts`` (wall-clock seconds) is set once per request, on the first
    output sent: the non-streaming body or the first stream chunk (TM 2025-2029, 2055-2059)."""
    opts = SGLangOptions(incremental_streaming_output=mode == "incremental")
    before = time.time()
    async with sglang_engine(opts, eos_probability=0.0) as eng:
        reply = await generate(session, eng.url, body(max_new_tokens=5, stream=mode != "body"))
    after = time.time()
    outs = [reply.json] if mode == "body" else stream_outputs(reply)
    assert len(outs) == 1 if mode == "body" else len(outs) >= 2
    assert [SENT in o["meta_info"] for o in outs] == [True] + [False] * (len(outs) - 1)
    assert before <= outs[0]["meta_info"][SENT] <= after
    assert list(outs[0]["meta_info"])[-1] == SENT, "appended after every other key"
    assert [output_problems(o, incremental=mode == "incremental") for o in outs] == [[]] * len(outs)


async def test_a_queued_abort_echo_sent_first_carries_the_send_time(session: aiohttp.ClientSession) -> None:
    """A non-streaming request retracted and aborted: the tokenizer's echo is its first output."""
    async with sglang_engine(**SLOW) as eng:
        task = asyncio.create_task(generate(session, eng.url, body("q", 4000)))
        await eng.core.wait_for_tokens("q", 3)
        assert (await post(session, eng.url + "/pause_generation", {"mode": "retract"})).status == 200
        assert (await post(session, eng.url + "/abort_request", {"rid": "q"})).status == 200
        reply = await task
        assert (await post(session, eng.url + "/continue_generation", {})).status == 200
    meta = reply.json["meta_info"]
    assert S.QUEUED_ABORT_META.problems(meta) == []
    assert list(meta)[-1] == SENT and isinstance(meta[SENT], float)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_aborted_output_has_finish_abort(session: aiohttp.ClientSession, stream: bool) -> None:
    async with sglang_engine(**SLOW) as eng:
        task = asyncio.create_task(generate(session, eng.url, body("victim", 4000, stream=stream)))
        await eng.core.wait_for_tokens("victim", 2)
        r = await post(session, eng.url + "/abort_request", {"rid": "victim"})
        reply = await task
    assert (r.status, r.raw) == (200, b""), S.ABORT_SOURCE
    out = stream_outputs(reply)[-1] if stream else reply.json
    assert output_problems(out) == []
    assert S.FINISH_ABORT.problems(out["meta_info"]["finish_reason"]) == []


async def test_the_queued_abort_echo_has_the_tokenizers_own_shape(session: aiohttp.ClientSession) -> None:
    """Aborted while retracted (waiting queue) under incremental streaming: ``_handle_abort_req``'s
    output, ``output_ids`` only the last id, ``completion_tokens`` all (TM 3577-3640)."""
    opts = SGLangOptions(incremental_streaming_output=True)
    async with sglang_engine(opts, **SLOW) as eng:
        task = asyncio.create_task(generate(session, eng.url, body("q", 4000, stream=True)))
        await eng.core.wait_for_tokens("q", 3)
        assert (await post(session, eng.url + "/pause_generation", {"mode": "retract"})).status == 200
        assert (await post(session, eng.url + "/abort_request", {"rid": "q"})).status == 200
        chunks = stream_outputs(await task)
        assert (await post(session, eng.url + "/continue_generation", {})).status == 200
    last = chunks[-1]
    meta = last["meta_info"]
    assert S.QUEUED_ABORT_OUTPUT.problems(last) == []
    assert S.QUEUED_ABORT_META.problems(meta) == []
    assert S.QUEUED_ABORT_FINISH.problems(meta["finish_reason"]) == []
    streamed = [i for c in chunks[:-1] for i in c["output_ids"]]
    assert last["output_ids"] == streamed[-1:] and meta["completion_tokens"] == len(streamed)
    assert [t[1] for t in meta["output_token_logprobs"]] == streamed  # whole, not sliced
    assert SENT not in meta, "the send time was on the first chunk"
    assert "dp_rank" not in meta, "the tokenizer builds the echo itself (TM 3603-3608)"


async def test_control_routes_answer_0523_bodies(session: aiohttp.ClientSession) -> None:
    async with sglang_engine() as eng:
        paused = await post(session, eng.url + "/pause_generation", {"mode": "abort"})
        flushed = await post(session, eng.url + "/flush_cache")
        resumed = await post(session, eng.url + "/continue_generation", {})
        aborted = await post(session, eng.url + "/abort_request", {"abort_all": True})
        version = await post(session, eng.url + "/update_weight_version", {"new_version": "v7"})
    assert paused.status == resumed.status == 200
    assert S.PAUSE_OK.problems(paused.json) == [] and S.CONTINUE_OK.problems(resumed.json) == []
    assert (flushed.status, flushed.raw.decode()) == (200, S.FLUSH_OK_TEXT), S.FLUSH_SOURCE
    assert (aborted.status, aborted.raw) == (200, b""), S.ABORT_SOURCE
    assert version.status == 200 and S.UPDATE_WEIGHT_VERSION_OK.problems(version.json) == []
    assert version.json["message"] == "Weight version updated to v7"


async def test_weight_routes_answer_0523_bodies(session: aiohttp.ClientSession, tmp_path: Any) -> None:
    group = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    tensors = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 2]]}
    async with sglang_engine() as eng:
        disk = await post(
            session, eng.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "none")}
        )
        init = await post(session, eng.url + "/init_weights_update_group", group)
        dist = await post(session, eng.url + "/update_weights_from_distributed", tensors)
        release = await post(session, eng.url + "/release_memory_occupation", {})
        resume = await post(session, eng.url + "/resume_memory_occupation", {})
    assert disk.status == 400 and S.UPDATE_FROM_DISK.problems(disk.json) == []
    assert disk.json["success"] is False
    assert init.status == dist.status == 200
    assert S.SUCCESS_MESSAGE.problems(init.json) == [] and S.SUCCESS_MESSAGE.problems(dist.json) == []
    assert (release.status, release.raw, resume.status, resume.raw) == (200, b"null", 200, b"null"), (
        S.MEMORY_SOURCE
    )


async def test_discovery_answers_0523_bodies(session: aiohttp.ClientSession) -> None:
    async with sglang_engine() as eng:
        info = await get(session, eng.url + "/server_info")
        model = await get(session, eng.url + "/model_info")
    assert info.status == model.status == 200
    assert S.SERVER_INFO.problems(info.json) == []
    assert S.MODEL_INFO.problems(model.json) == []


async def test_each_error_envelope_has_the_0523_shape(session: aiohttp.ClientSession) -> None:
    async with sglang_engine() as eng:
        native = await generate(session, eng.url, body(input_ids=[]))
        in_stream = await generate(session, eng.url, body(input_ids=[], stream=True))
        validation = await post(session, eng.url + "/pause_generation")
        contract = await generate(session, eng.url, body(sp={"no_such_key": 1}))
    assert native.status == 400
    assert (
        S.ERROR_NATIVE.problems(native.json) == []
        and S.ERROR_NATIVE_INNER.problems(native.json["error"]) == []
    )
    (event,) = stream_outputs(in_stream)
    assert S.ERROR_STREAM.problems(event) == [] and S.ERROR_STREAM_INNER.problems(event["error"]) == []
    assert event["error"]["code"] == 400
    assert validation.status == 400 and S.ERROR_VALIDATION.problems(validation.json) == []
    assert contract.status == 400 and S.ERROR_CONTRACT.problems(contract.json) == []


# --------------------------------------------------------------------------- the wedge, simulator only
#: Bound of a wait that must time out: the wedged pause never answers, so any bound is reached;
#: it only limits how long the test takes. The release is observed on the engine's own state.
WEDGE_PROBE_S = 0.5


async def test_abort_pause_over_in_place_hangs_until_its_requests_end(session: aiohttp.ClientSession) -> None:
    """0.5.23: ``pause(abort)`` waits under ``is_pause_cond`` until the in-flight requests release
    ``model_update_lock`` (TM 2267-2280); requests frozen ``in_place`` never step (SCH 2033-2036),
    so their abort (``to_finish``, SCH 5812) never applies (SB 2007-2014) and the pause does not
    answer. ``/continue_generation`` takes the same condition (TM 2282-2286), so it waits behind the
    pause: nothing the HTTP surface offers releases it. Here the release is the end of the frozen
    requests (the simulator's ``abort`` of the request, a process restart's stand-in)."""
    async with sglang_engine(**SLOW) as eng:
        state = eng.app[SGLANG_KEY]
        tasks = [
            asyncio.create_task(generate(session, eng.url, body(f"r{i}", 4000, stream=True)))
            for i in range(2)
        ]
        for i in range(2):
            await eng.core.wait_for_tokens(f"r{i}", 2)
        assert (await post(session, eng.url + "/pause_generation", {"mode": "in_place"})).status == 200
        pause = asyncio.create_task(post(session, eng.url + "/pause_generation", {"mode": "abort"}))
        await eng.core.wait_until(lambda: state.wedged)
        done, _ = await asyncio.wait({pause}, timeout=WEDGE_PROBE_S)
        assert not done, "an abort pause over in_place answered: 0.5.23 waits for the frozen requests"
        resume = asyncio.create_task(post(session, eng.url + "/continue_generation", {}))
        await eng.core.wait_until(lambda: eng.core.stats.resume_calls == 1)
        done, _ = await asyncio.wait({pause, resume}, timeout=WEDGE_PROBE_S)
        assert not done, "continue_generation got past the abort pause's lock"
        assert all(not t.done() for t in tasks), "a frozen request ended while wedged"
        for r in state.admitted():  # the engine restarts: its requests end
            r.abort()
        paused, resumed = await pause, await resume
        finals = [stream_outputs(await t)[-1] for t in tasks]
    assert (paused.status, resumed.status) == (200, 200)
    assert S.PAUSE_OK.problems(paused.json) == [] and not state.wedged
    assert all(f["meta_info"]["finish_reason"]["type"] == "abort" for f in finals)
