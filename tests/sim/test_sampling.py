"""The toy model and sampler: determinism, seeds, filters, penalties, stops, logprob rules."""

from __future__ import annotations

import math
from typing import Any

import aiohttp
import numpy as np
import pytest

from rollout_grpc.sim import SimEngine
from rollout_grpc.sim.model import ToyLM, context_hash, get_tables, roll
from tests.support.sim_http import PROMPT, EngineFactory, gen_body, generate


async def _ids(session: aiohttp.ClientSession, eng: SimEngine, **kw: Any) -> list[int]:
    r = await generate(session, eng.url, gen_body(**kw))
    assert r.status == 200, r.json
    ids: list[int] = r.json["choices"][0]["token_ids"]
    return ids


async def _choice(session: aiohttp.ClientSession, eng: SimEngine, body: dict[str, Any]) -> dict[str, Any]:
    r = await generate(session, eng.url, body)
    assert r.status == 200, r.json
    c: dict[str, Any] = r.json["choices"][0]
    return c


async def test_greedy_is_deterministic_across_engines(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    async with make_engine(seed=1, eos_probability=0.0) as a, make_engine(seed=2, eos_probability=0.0) as b:
        x = await _ids(session, a, max_tokens=40, temperature=0)
        assert x == await _ids(session, a, max_tokens=40, temperature=0)
        assert x == await _ids(session, b, max_tokens=40, temperature=0)  # same "weights" (model_seed)
    async with make_engine(model_seed=7, eos_probability=0.0) as c:
        assert x != await _ids(session, c, max_tokens=40, temperature=0)


async def test_greedy_continuation_reproduces_tail(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    whole = await _ids(session, engine, max_tokens=30, temperature=0)
    tail = await _choice(
        session,
        engine,
        {"token_ids": PROMPT + whole[:12], "sampling_params": {"max_tokens": 18, "temperature": 0}},
    )
    assert tail["token_ids"] == whole[12:]


async def test_seeded_sampling(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    a = await _ids(session, engine, max_tokens=30, seed=11)
    assert a == await _ids(session, engine, max_tokens=30, seed=11)
    assert a != await _ids(session, engine, max_tokens=30, seed=12)
    body = gen_body(max_tokens=10, seed=3, n=3)
    r = (await generate(session, engine.url, body)).json
    outs = [c["token_ids"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert len({tuple(o) for o in outs}) == 3
    assert outs == [c["token_ids"] for c in (await generate(session, engine.url, body)).json["choices"]]
    assert r["usage"]["completion_tokens"] == 30
    # vLLM seeds child i of an n>1 request with seed + i
    assert outs[1] == await _ids(session, engine, max_tokens=10, seed=4)


async def test_unseeded_sampling_varies(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    seen = {tuple(await _ids(session, engine, max_tokens=12)) for _ in range(4)}
    assert len(seen) > 1


async def test_greedy_n_rejected(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    r = await generate(session, engine.url, gen_body(max_tokens=2, temperature=0, n=2))
    assert r.status == 400
    assert r.json["error"]["message"] == "n must be 1 when using greedy sampling, got 2."


async def test_top_k_one_is_greedy(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    greedy = await _ids(session, engine, max_tokens=20, temperature=0)
    assert await _ids(session, engine, max_tokens=20, temperature=1.3, top_k=1, seed=5) == greedy
    assert await _ids(session, engine, max_tokens=20, temperature=1.0, top_p=1e-6, seed=5) == greedy
    assert await _ids(session, engine, max_tokens=20, temperature=1.0, min_p=1.0, seed=5) == greedy


async def test_logit_bias_and_allowed_ids(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    assert (
        await _ids(session, engine, max_tokens=4, temperature=0, logit_bias={"777": 100}, ignore_eos=True)
        == [777] * 4
    )
    allowed = [300, 301, 302]
    out = await _ids(session, engine, max_tokens=30, allowed_token_ids=allowed, seed=1)
    assert set(out) <= set(allowed)


async def test_penalties_reduce_repetition(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    base = await _ids(session, engine, max_tokens=60, temperature=0, logit_bias={"900": 3.0, "901": 3.0})
    pen = await _ids(
        session,
        engine,
        max_tokens=60,
        temperature=0,
        logit_bias={"900": 3.0, "901": 3.0},
        frequency_penalty=2.0,
    )
    assert pen.count(900) + pen.count(901) < base.count(900) + base.count(901)
    rep = await _ids(
        session, engine, max_tokens=60, temperature=0, logit_bias={"900": 3.0}, repetition_penalty=2.0
    )
    assert rep.count(900) < base.count(900)
    pres = await _ids(
        session, engine, max_tokens=60, temperature=0, logit_bias={"900": 3.0}, presence_penalty=2.0
    )
    assert pres.count(900) < base.count(900)


async def test_eos_stops_and_is_kept(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(eos_probability=0.2) as eng:
        lengths = []
        for seed in range(10):
            c = await _choice(session, eng, gen_body(max_tokens=400, seed=seed))
            if c["finish_reason"] == "stop":
                assert c["token_ids"][-1] == 2 and c["stop_reason"] is None
                assert 2 not in c["token_ids"][:-1]
            lengths.append(len(c["token_ids"]))
        assert min(lengths) < 400  # EOS is reachable in ordinary runs
        c = await _choice(session, eng, gen_body(max_tokens=100, temperature=0, ignore_eos=True))
        assert c["finish_reason"] == "length" and len(c["token_ids"]) == 100
        c = await _choice(session, eng, gen_body(max_tokens=100, temperature=0, min_tokens=50))
        assert len(c["token_ids"]) >= 50 and 2 not in c["token_ids"][:49]


async def test_stop_token_and_string(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    ref = await _choice(session, engine, {**gen_body(max_tokens=30, temperature=0), "output_mode": "text"})
    tok = ref["token_ids"][6]
    c = await _choice(
        session,
        engine,
        {**gen_body(max_tokens=30, temperature=0, stop_token_ids=[tok]), "output_mode": "text"},
    )
    first = ref["token_ids"].index(tok)
    assert c["token_ids"] == ref["token_ids"][: first + 1]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", tok)
    # the stop token's text is not in the output text
    assert ref["text"].startswith(c["text"]) and len(c["text"]) < len(ref["text"])
    # stop string: cut in the text, every token kept
    text = ref["text"]
    stop = text[20:23]
    c = await _choice(
        session, engine, {**gen_body(max_tokens=30, temperature=0, stop=[stop]), "output_mode": "text"}
    )
    assert c["text"] == text[: text.index(stop)] and c["stop_reason"] == stop
    covered = await generate(
        session, engine.url, {"token_ids": PROMPT + c["token_ids"], "sampling_params": {"max_tokens": 1}}
    )
    assert covered.status == 200


async def test_length_capped_by_max_model_len(
    make_engine: EngineFactory, session: aiohttp.ClientSession
) -> None:
    async with make_engine(max_model_len=64, eos_probability=0.0) as eng:
        c = await _choice(session, eng, gen_body(max_tokens=1000))
        assert c["finish_reason"] == "length" and len(c["token_ids"]) == 64 - len(PROMPT)
        c = await _choice(session, eng, gen_body(max_tokens=None))
        assert len(c["token_ids"]) == 64 - len(PROMPT)


async def test_logprobs_are_normalised(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    c = await _choice(session, engine, gen_body(max_tokens=20, logprobs=5, seed=2))
    for e in c["logprobs"]["content"]:
        assert -9999.0 <= e["logprob"] <= 0.0
        assert e["top_logprobs"][0]["token_id"] == e["token_id"]
        assert len(e["top_logprobs"]) == 5
        lps = [t["logprob"] for t in e["top_logprobs"][1:]]
        assert lps == sorted(lps, reverse=True)
        assert e["logprob"] == np.float32(e["logprob"])  # float32 values, as the real sampler gives
    tables = get_tables(2048, 0)
    probs = np.exp(tables.logprobs.astype(np.float64)).sum(axis=1)
    assert np.allclose(probs, 1.0, atol=1e-4)
    lm = ToyLM(2048, 0, 1.0)
    row, eos_step = lm.step_state(context_hash(PROMPT))
    assert eos_step
    assert math.isclose(
        float(np.exp(lm.full_logprobs(row, True).astype(np.float64)).sum()), 1.0, rel_tol=1e-4
    )


def test_rolling_hash_matches_full_hash() -> None:
    h = context_hash(PROMPT[:5])
    for t in PROMPT[5:]:
        h = roll(h, t)
    assert h == context_hash(PROMPT)


async def test_prompt_logprobs(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    r = await generate(
        session,
        engine.url,
        {"token_ids": PROMPT[:6], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}},
    )
    plp = r.json["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 6
    for pos, entry in enumerate(plp[1:], start=1):
        keys = list(entry)
        assert keys[0] == str(PROMPT[pos])
        assert 1 <= len(keys) <= 2
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert any(v["rank"] == 1 for v in entry.values())


@pytest.mark.parametrize(
    ("sp", "param", "message"),
    [
        (
            {"temperature": 2.5},
            "temperature",
            "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
        ),
        ({"presence_penalty": 3}, None, "presence_penalty must be in [-2, 2], got 3.0."),
        ({"top_k": -2}, None, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"min_p": 1.5}, None, "min_p must be in [0, 1], got 1.5."),
        (
            {"min_tokens": 5, "max_tokens": 2},
            None,
            "min_tokens must be less than or equal to max_tokens=2, got 5.",
        ),
        ({"stop": [""]}, None, "stop cannot contain an empty string."),
        (
            {"logprobs": -1},
            "logprobs",
            "Requested sample logprobs of 2048, which is greater than max allowed: 20 "
            "(parameter=logprobs, value=2048)",
        ),
    ],
)
async def test_sampling_param_errors(
    engine: SimEngine, session: aiohttp.ClientSession, sp: dict[str, Any], param: str | None, message: str
) -> None:
    r = await generate(session, engine.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, **sp}})
    assert r.status == 400
    assert r.json == {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


async def test_text_mode_logprobs_shape(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    c = await _choice(
        session, engine, {**gen_body(max_tokens=5, temperature=0, logprobs=2), "output_mode": "text"}
    )
    assert list(c) == [
        "index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
        "weight_versions", "text", "logprobs",
    ]  # fmt: skip
    for e in c["logprobs"]["content"]:
        assert list(e) == ["token", "logprob", "bytes", "top_logprobs"]
        assert e["bytes"] == list(e["token"].encode())
        assert [list(t) for t in e["top_logprobs"]] == [["token", "logprob", "bytes"]] * 2
    assert "".join(e["token"] for e in c["logprobs"]["content"]) == c["text"]
