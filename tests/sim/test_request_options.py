"""Request options and validators that the golden files do not cover (behaviour from vLLM 0.32's source)."""

from __future__ import annotations

from typing import Any

import aiohttp

from rollout_grpc.sim import SimEngine
from tests.support.sim_http import PROMPT, EngineFactory, gen_body, generate, get, post


async def test_stream_interval(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    body = {**gen_body(max_tokens=10, temperature=0, stream_interval=4), "stream": True}
    events = (await generate(session, engine.url, body)).events
    sizes = [len(e["choices"][0]["token_ids"]) for e in events[:-1]]
    assert sizes == [1, 4, 4, 1]  # first output at once, then every 4, the final one at once
    plain = (await generate(session, engine.url, gen_body(max_tokens=10, temperature=0))).json
    streamed = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert streamed == plain["choices"][0]["token_ids"]


async def test_mid_stream_error_bytes(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    engine.faults.stream_error = 1
    engine.faults.stream_error_after = 0
    r = await generate(session, engine.url, {**gen_body(max_tokens=3), "stream": True})
    assert r.raw == (
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
        b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n'
    )


async def test_cache_salt_validation(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    ok = await generate(session, engine.url, {**gen_body(max_tokens=1), "cache_salt": "salt-1"})
    assert ok.status == 200
    for salt, message in [
        ("", "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"),
        (
            "a/b",
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', "
            "or NUL. (parameter=cache_salt)",
        ),
    ]:
        r = await generate(session, engine.url, {**gen_body(max_tokens=1), "cache_salt": salt})
        assert r.status == 400
        assert r.json == {
            "error": {"message": message, "type": "BadRequestError", "param": "cache_salt", "code": 400}
        }


async def test_model_level_validators(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    feats = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}
    parts = [{"type": "image_url", "url": "data:image/png;base64,AAAA"}]
    r = await generate(
        session, engine.url, {**gen_body(max_tokens=1), "features": feats, "content_parts": parts}
    )
    assert (
        r.status == 400 and "content_parts and features are mutually exclusive" in r.json["error"]["message"]
    )
    meta_only = {**feats, "kwargs_data": None, "mm_metadata": {"image": ["bWV0YQ=="]}}
    r = await generate(session, engine.url, {**gen_body(max_tokens=1), "features": meta_only})
    assert (
        r.status == 400
        and "metadata-only multimodal items require ec_transfer_params" in r.json["error"]["message"]
    )
    assert engine.stats.generate_started == 0


async def test_unknown_keys_and_types(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    r = await generate(session, engine.url, {**gen_body(max_tokens=1, nonsense=True), "extra_top": {"x": 1}})
    assert r.status == 200
    r = await generate(session, engine.url, {"token_ids": [1, "x"], "sampling_params": {}})
    assert r.status == 400 and r.json["error"]["param"] == "body.token_ids.1"
    r = await generate(session, engine.url, {**gen_body(max_tokens=1), "output_mode": "bytes"})
    assert r.status == 400 and r.json["error"]["param"] == "body.output_mode"


async def test_tokens_only_server(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(tokens_only=True, scale_out=False) as eng:
        assert (await generate(session, eng.url, gen_body(max_tokens=2, logprobs=1))).status == 200
        r = await generate(session, eng.url, gen_body(max_tokens=2, stop=["x"]))
        assert r.status == 400 and r.json["error"]["message"].startswith(
            "stop strings are not supported on a"
        )
        r = await generate(session, eng.url, {**gen_body(max_tokens=2), "output_mode": "text"})
        assert r.status == 400 and "requires a tokenizer" in r.json["error"]["message"]
        r = await post(session, eng.url + "/tokenize", {"prompt": "hi"})
        assert r.json["error"]["message"] == "Tokenizer not available when skip_tokenizer_init=True"


async def test_server_info(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async def info(eng: SimEngine) -> dict[str, Any]:
        body: dict[str, Any] = (await get(session, eng.url + "/server_info?config_format=json")).json
        return body

    async with (
        make_engine() as dense,
        make_engine(moe_experts=16) as moe,
        make_engine(return_routed_experts=True) as r3,
    ):
        d, m, r = await info(dense), await info(moe), await info(r3)
        assert list(d) == ["vllm_config", "vllm_env", "system_env"]
        assert d["vllm_config"]["parallel_config"]["is_moe_model"] is False
        assert m["vllm_config"]["parallel_config"]["is_moe_model"] is True
        assert m["vllm_config"]["aux_output_config"]["enable_return_routed_experts"] is False
        assert r["vllm_config"]["aux_output_config"]["enable_return_routed_experts"] is True
        r3.faults.routed_experts_unavailable = True
        assert (await info(r3))["vllm_config"]["aux_output_config"]["enable_return_routed_experts"] is False
        text = (await get(session, dense.url + "/server_info")).json
        assert isinstance(text["vllm_config"], str)


async def test_max_num_seqs_and_n(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(max_num_seqs=4) as eng:
        r = await generate(session, eng.url, gen_body(max_tokens=1, n=5))
        assert (
            r.json["error"]["message"]
            == "sampling_params.n must be at most the server's max_num_seqs (4), got 5."
        )
        r = await generate(session, eng.url, {**gen_body(max_tokens=3, n=4, seed=1), "stream": True})
        by_index: dict[int, int] = {}
        for e in r.events[:-1]:
            c = e["choices"][0]
            by_index[c["index"]] = by_index.get(c["index"], 0) + len(c["token_ids"])
        assert by_index == {0: 3, 1: 3, 2: 3, 3: 3}


async def test_prompt_at_context_limit(make_engine: EngineFactory, session: aiohttp.ClientSession) -> None:
    async with make_engine(max_model_len=len(PROMPT), eos_probability=0.0) as eng:
        r = await generate(session, eng.url, gen_body(max_tokens=5))
        assert r.status == 400
        assert r.json["error"]["message"] == (
            "The decoder prompt (length 20) plus the number of requested output tokens (at least 1) is "
            "longer than the maximum model length of 20. Make sure that `max_model_len` is no smaller than "
            "the number of text tokens (prompt + requested output tokens)."
        )
    async with make_engine(max_model_len=len(PROMPT) + 1, eos_probability=0.0) as eng:
        r = await generate(session, eng.url, gen_body(max_tokens=5))
        assert r.status == 200 and len(r.json["choices"][0]["token_ids"]) == 1


async def test_sampling_params_verify(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    """``SamplingParams.verify``: token ids inside the vocabulary, logprob_token_ids limits."""
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {"stop_token_ids": [5, 5000]},
            "stop_token_ids",
            "token_id(s) [5000] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 2048 "
            "(parameter=stop_token_ids, value=[5000])",
        ),
        (
            {"logit_bias": {"9999": 1.0}},
            "logit_bias",
            "token_id(s) [9999] in logit_bias contain out-of-vocab token ids. Vocabulary size: 2048 "
            "(parameter=logit_bias, value=[9999])",
        ),
        (
            {"allowed_token_ids": []},
            "allowed_token_ids",
            "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])",
        ),
        (
            {"logprobs": 2, "logprob_token_ids": [1, 2, 3]},
            "logprob_token_ids",
            "When both logprobs and logprob_token_ids are set, logprobs must equal len(logprob_token_ids). "
            "Got logprobs=2, len(logprob_token_ids)=3. (parameter=logprob_token_ids, value=3)",
        ),
    ]
    for sp, param, message in cases:
        r = await generate(session, engine.url, gen_body(max_tokens=1, **sp))
        assert r.status == 400
        assert r.json == {
            "error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}
        }
