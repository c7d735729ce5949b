"""The simulator against the bodies recorded from vLLM 0.32 (tiny-llama, ``r_dense.json``).

Same requests, same status, content type and structure (keys, key order, types, null placement);
error bodies byte for byte. Token ids and logprob values are not compared (random weights).
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import pytest

from rollout_grpc.sim import SimEngine
from tests.support.conformance import assert_same_shape, parse_sse, shape_of, stream_shape_diff
from tests.support.sim_http import PROMPT, generate, get, golden, post

DENSE = golden("r_dense")


def _request(rec: dict[str, Any]) -> dict[str, Any]:
    req = dict(rec["request"])
    return req


@pytest.mark.parametrize(
    "case",
    [
        "tokens_greedy_logprobs2",
        "tokens_sampled_logprobs0_seed",
        "text_mode_no_request_id",
        "prompt_logprobs1",
        "n2",
        "eos_forced_by_logit_bias",
        "eos_ignored",
        "unknown_keys",
        "detokenize_false",
    ],
)
async def test_generate_bodies(tiny_llama: SimEngine, session: aiohttp.ClientSession, case: str) -> None:
    rec = DENSE["generate"][case]
    r = await generate(session, tiny_llama.url, _request(rec))
    assert r.status == rec["status"]
    assert r.content_type == "application/json"
    body = r.json
    assert_same_shape(rec["body"], body)
    want = rec["body"]
    for c_want, c_got in zip(want["choices"], body["choices"], strict=True):
        assert c_got["finish_reason"] == c_want["finish_reason"]
        assert c_got["stop_reason"] == c_want["stop_reason"]
        assert len(c_got["token_ids"]) == len(c_want["token_ids"])
    assert body["usage"] == want["usage"]
    if "request_id" in rec["request"]:
        assert body["request_id"] == want["request_id"]
    else:
        assert re.fullmatch(r"generate-tokens-[0-9a-f]{16}", body["request_id"])


async def test_eos_forced_and_ignored(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    forced = (
        await generate(session, tiny_llama.url, DENSE["generate"]["eos_forced_by_logit_bias"]["request"])
    ).json
    assert forced["choices"][0]["token_ids"] == [2]
    lp = forced["choices"][0]["logprobs"]["content"][0]
    assert lp["rank"] > 1  # raw logprobs: the bias is not part of them
    ignored = (await generate(session, tiny_llama.url, DENSE["generate"]["eos_ignored"]["request"])).json
    assert ignored["choices"][0]["token_ids"] == [2, 2, 2]


async def test_same_seed_same_tokens(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    req = DENSE["generate"]["tokens_sampled_logprobs0_seed"]["request"]
    a = (await generate(session, tiny_llama.url, req)).json["choices"][0]["token_ids"]
    b = (await generate(session, tiny_llama.url, req)).json["choices"][0]["token_ids"]
    assert a == b
    assert DENSE["generate"]["same_seed_again"]["same_tokens"] is True


async def test_max_tokens_omitted_fills_context(
    tiny_llama: SimEngine, session: aiohttp.ClientSession
) -> None:
    rec = DENSE["generate"]["max_tokens_omitted"]
    r = await generate(session, tiny_llama.url, rec["request"])
    assert r.status == 200
    assert r.json["usage"] == rec["usage"]
    assert len(r.json["choices"][0]["token_ids"]) == rec["n_tokens"]


async def test_x_request_id_header_wins(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["generate"]["x_request_id_header"]
    r = await generate(session, tiny_llama.url, rec["request"], headers={"X-Request-Id": "hdr-id"})
    assert r.json["request_id"] == rec["body_request_id"]
    assert "X-Request-Id" not in r.headers and rec["resp_header"] is None


@pytest.mark.parametrize("case", ["tokens_logprobs_usage", "tokens_plain", "text_mode", "n2"])
async def test_stream_chunks(tiny_llama: SimEngine, session: aiohttp.ClientSession, case: str) -> None:
    rec = DENSE["stream"][case]
    r = await generate(session, tiny_llama.url, rec["request"])
    assert r.status == 200
    assert r.content_type == "text/event-stream; charset=utf-8"
    expected = parse_sse(rec["raw_sse"])
    actual = r.events
    assert stream_shape_diff(expected, actual) == []
    if case != "n2":  # single choice: the exact order of chunks and their key sets agree
        assert [shape_of(e) for e in actual] == [shape_of(e) for e in expected]


async def test_stream_usage_chunk_exact(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["stream"]["tokens_logprobs_usage"]
    events = (await generate(session, tiny_llama.url, rec["request"])).events
    want = parse_sse(rec["raw_sse"])
    assert events[-2] == want[-2]  # the include_usage chunk (exclude_none shape)
    assert events[0]["prompt_token_ids"] == rec["request"]["token_ids"]
    assert [e["usage"] for e in events[:-2]] == [w["usage"] for w in want[:-2]]


async def _reference(eng: SimEngine, session: aiohttp.ClientSession) -> dict[str, Any]:
    ref = DENSE["stops"]["reference_greedy_16"]["request"]
    choice: dict[str, Any] = (await generate(session, eng.url, ref)).json["choices"][0]
    return choice


async def test_stop_token_ids(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["stops"]["stop_token_ids"]
    ref = await _reference(tiny_llama, session)
    stop_tok = ref["token_ids"][4]  # the recording stopped on the 5th greedy token too
    req = dict(rec["request"])
    req["sampling_params"] = {**req["sampling_params"], "stop_token_ids": [stop_tok]}
    body = (await generate(session, tiny_llama.url, req)).json
    assert_same_shape(rec["body"], body)
    ch = body["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop_tok
    assert ch["token_ids"] == ref["token_ids"][:5]
    assert ch["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]


@pytest.mark.parametrize("include", [False, True])
async def test_stop_strings(tiny_llama: SimEngine, session: aiohttp.ClientSession, include: bool) -> None:
    rec = DENSE["stops"][f"stop_string_include_{include}"]
    ref = await _reference(tiny_llama, session)
    text = ref["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    req = dict(rec["request"])
    req["sampling_params"] = {**req["sampling_params"], "stop": [stop]}
    body = (await generate(session, tiny_llama.url, req)).json
    assert_same_shape(rec["body"], body)
    ch = body["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    cut = text.index(stop)
    assert ch["text"] == (text[: cut + len(stop)] if include else text[:cut])
    # token_ids keep every token up to the one that completed the stop string
    assert ch["token_ids"] == ref["token_ids"][: len(ch["token_ids"])]


async def test_stop_string_tokens_mode(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["stops"]["stop_string_tokens_mode"]
    ref = await _reference(tiny_llama, session)
    stop = ref["text"][10:13]
    req = dict(rec["request"])
    req["sampling_params"] = {**req["sampling_params"], "stop": [stop]}
    body = (await generate(session, tiny_llama.url, req)).json
    assert_same_shape(rec["body"], body)
    assert body["choices"][0]["stop_reason"] == stop


async def test_min_tokens_suppresses_stop_token(
    tiny_llama: SimEngine, session: aiohttp.ClientSession
) -> None:
    rec = DENSE["stops"]["stop_token_ids_with_min_tokens8"]
    ref = await _reference(tiny_llama, session)
    stop_tok = ref["token_ids"][4]
    req = dict(rec["request"])
    req["sampling_params"] = {**req["sampling_params"], "stop_token_ids": [stop_tok]}
    body = (await generate(session, tiny_llama.url, req)).json
    assert_same_shape(rec["body"], body)
    ids = body["choices"][0]["token_ids"]
    assert stop_tok not in ids[:8]
    assert ids[:4] == ref["token_ids"][:4]


async def test_length(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["stops"]["max_tokens_length"]
    body = (await generate(session, tiny_llama.url, rec["request"])).json
    assert_same_shape(rec["body"], body)
    assert body["choices"][0]["finish_reason"] == "length"


ERROR_CASES = [
    "missing_sampling_params",
    "empty_token_ids",
    "negative_token_id",
    "token_id_out_of_vocab",
    "wrong_model",
    "logprobs_too_many",
    "bad_temperature",
    "bad_top_p",
    "n_too_big",
    "text_mode_detok_false",
    "max_tokens_zero",
]


@pytest.mark.parametrize("case", ERROR_CASES)
async def test_error_bodies_exact(tiny_llama: SimEngine, session: aiohttp.ClientSession, case: str) -> None:
    rec = DENSE["errors"][case]
    r = await generate(session, tiny_llama.url, rec["request"])
    assert r.status == rec["status"]
    assert r.content_type == "application/json"
    assert r.json == rec["body"]
    assert tiny_llama.stats.generate_started == 0


async def test_prompt_too_long_exact(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["errors"]["prompt_too_long"]
    r = await generate(
        session, tiny_llama.url, {"token_ids": [5] * 600, "sampling_params": {"max_tokens": 1}}
    )
    assert (r.status, r.json) == (rec["status"], rec["body"])


async def test_prompt_plus_max_tokens_is_cut(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["errors"]["prompt_plus_max_tokens_too_long"]
    r = await generate(
        session, tiny_llama.url, {"token_ids": [5] * 500, "sampling_params": {"max_tokens": 100}}
    )
    assert r.status == 200
    assert_same_shape(rec["body"], r.json)
    assert r.json["usage"] == rec["body"]["usage"]


async def test_priority_nonzero_accepted(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["errors"]["priority_nonzero"]
    r = await generate(session, tiny_llama.url, rec["request"])
    assert r.status == 200
    assert_same_shape(rec["body"], r.json)


async def test_malformed_json_and_content_type(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    url = tiny_llama.url + "/inference/v1/generate"
    r = await post(session, url, data=b"{not json", headers={"Content-Type": "application/json"})
    assert (r.status, r.json) == (400, DENSE["errors"]["malformed_json"]["body"])
    r = await post(session, url, data=b"hello", headers={"Content-Type": "text/plain"})
    assert (r.status, r.json) == (400, DENSE["errors"]["wrong_content_type"]["body"])


async def test_pause_bad_mode_exact(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    r = await post(session, tiny_llama.url + "/pause?mode=bogus")
    assert (r.status, r.json) == (400, DENSE["errors"]["pause_bad_mode"]["body"])


async def test_meta_endpoints(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    meta = DENSE["meta"]
    for path in ("/health", "/ping"):
        r = await get(session, tiny_llama.url + path)
        assert (r.status, r.raw, r.content_type) == (200, b"", meta[path]["headers"]["content-type"])
    for path in ("/version", "/load", "/is_paused"):
        r = await get(session, tiny_llama.url + path)
        assert r.content_type == "application/json"
        assert r.json == meta[path]["body"]
    r = await get(session, tiny_llama.url + "/v1/models")
    assert_same_shape(meta["/v1/models"]["body"], r.json)
    model = r.json["data"][0]
    want = meta["/v1/models"]["body"]["data"][0]
    assert {k: model[k] for k in ("id", "root", "max_model_len", "owned_by")} == {
        k: want[k] for k in ("id", "root", "max_model_len", "owned_by")
    }
    assert re.fullmatch(r"modelperm-[0-9a-f]{16}", model["permission"][0]["id"])


async def test_tokenize_detokenize(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    meta = DENSE["meta"]
    r = await post(
        session, tiny_llama.url + "/tokenize", {"prompt": "Hello world", "return_token_strs": True}
    )
    assert_same_shape(meta["/tokenize(prompt)"]["body"], r.json)
    # token_strs use the byte-level alphabet, like the real byte-level BPE ("\u0120" is a space)
    assert "".join(r.json["token_strs"]).replace("\u0120", " ") == "Hello world"
    assert any(t.startswith("\u0120") for t in r.json["token_strs"])
    msgs = {"messages": [{"role": "user", "content": "What is two plus two?"}], "add_generation_prompt": True}
    r = await post(session, tiny_llama.url + "/tokenize", msgs)
    assert_same_shape(meta["/tokenize(messages)"]["body"], r.json)
    d = await post(session, tiny_llama.url + "/detokenize", {"tokens": r.json["tokens"]})
    assert d.json == meta["/detokenize"]["body"]


async def test_metrics_lines(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["metrics"]["/metrics"]
    await generate(session, tiny_llama.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}})
    r = await get(session, tiny_llama.url + "/metrics")
    assert r.content_type == rec["content_type"]
    text = r.raw.decode()
    line_re = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\}) (-?\d+\.\d+(?:e[+-]?\d+)?)$")
    got = {m.group(1) + m.group(2) for line in text.splitlines() if (m := line_re.match(line))}
    for line in rec["selected"]:
        name_labels = line.rsplit(" ", 1)[0]
        if any(name_labels.startswith(p) for p in _REQUIRED_METRICS):
            assert name_labels in got, name_labels
    assert 'vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"}' in got
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny-llama"}' in got


_REQUIRED_METRICS = (
    "vllm:num_requests_running{",
    "vllm:num_requests_waiting{",
    "vllm:kv_cache_usage_perc{",
    "vllm:request_success_total{",
)


@pytest.mark.parametrize(
    ("path", "method", "body", "case"),
    [
        ("/weight_info", "GET", None, "/weight_info"),
        ("/get_world_size", "GET", None, "/get_world_size"),
        ("/is_sleeping", "GET", None, "/is_sleeping"),
        ("/is_paused", "GET", None, "/is_paused"),
        ("/reset_prefix_cache", "POST", None, "/reset_prefix_cache"),
        (
            "/collective_rpc",
            "POST",
            {"method": "check_health", "args": [], "kwargs": {}},
            "/collective_rpc(check_health)",
        ),
        ("/start_weight_update", "POST", None, "/start_weight_update"),
        ("/finish_weight_update", "POST", None, "/finish_weight_update"),
        ("/init_weight_transfer_engine", "POST", {}, "/init_weight_transfer_engine(empty)"),
    ],
)
async def test_rl_endpoints_exact(
    tiny_llama: SimEngine, session: aiohttp.ClientSession, path: str, method: str, body: Any, case: str
) -> None:
    rec = DENSE["rl"][case]
    r = await (
        get(session, tiny_llama.url + path) if method == "GET" else post(session, tiny_llama.url + path, body)
    )
    assert (r.status, r.json) == (rec["status"], rec["body"])


async def test_weight_version_and_sleep(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rl = DENSE["rl"]
    r = await post(session, tiny_llama.url + "/update_weight_version", {"new_version": "step-42"})
    assert r.json == rl["/update_weight_version"]["body"]
    assert (await get(session, tiny_llama.url + "/weight_info")).json == rl["/weight_info(after)"]["body"]
    g = await generate(session, tiny_llama.url, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
    assert g.json["choices"][0]["weight_versions"] == rl["generate_after_version_update"]["weight_versions"]
    assert (await post(session, tiny_llama.url + "/sleep?level=1")).json == rl["/sleep?level=1"]["body"]
    assert (await get(session, tiny_llama.url + "/is_sleeping")).json == rl["/is_sleeping(after sleep)"][
        "body"
    ]
    assert (await post(session, tiny_llama.url + "/wake_up")).json == rl["/wake_up"]["body"]
    assert (await get(session, tiny_llama.url + "/is_sleeping")).json == rl["/is_sleeping(after wake)"][
        "body"
    ]


async def test_chat_render(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["render"]["chat_render"]
    r = await post(session, tiny_llama.url + "/v1/chat/completions/render", rec["request"])
    assert r.status == 200
    body = r.json
    assert_same_shape(rec["body"], body)
    assert body["sampling_params"] == rec["body"]["sampling_params"]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["request_id"])
    want_text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok = await post(session, tiny_llama.url + "/detokenize", {"tokens": body["token_ids"]})
    assert tok.json["prompt"] == want_text
    # render then generate: the body goes back unchanged
    g = await generate(session, tiny_llama.url, body)
    want_g = DENSE["render"]["chat_render_then_generate"]["body"]
    assert_same_shape(want_g, g.json)
    assert g.json["request_id"] == "generate-tokens-" + body["request_id"]
    assert g.json["usage"]["completion_tokens"] == 5


async def test_chat_render_no_generation_prompt(
    tiny_llama: SimEngine, session: aiohttp.ClientSession
) -> None:
    rec = DENSE["render"]["chat_render_no_gen_prompt"]
    body = (await post(session, tiny_llama.url + "/v1/chat/completions/render", rec["request"])).json
    assert_same_shape(rec["body"], body)
    sp = dict(body["sampling_params"])
    assert sp.pop("max_tokens") == 512 - len(body["token_ids"])
    want = dict(rec["body"]["sampling_params"])
    want.pop("max_tokens")
    assert sp == want
    tok = await post(session, tiny_llama.url + "/detokenize", {"tokens": body["token_ids"]})
    assert tok.json["prompt"] == "<|im_start|>user\nhi<|im_end|>\n"


async def test_completions_render(tiny_llama: SimEngine, session: aiohttp.ClientSession) -> None:
    rec = DENSE["render"]["completions_render"]
    r = await post(session, tiny_llama.url + "/v1/completions/render", rec["request"])
    assert r.status == 200 and isinstance(r.json, list)
    assert_same_shape(rec["body"], r.json)
    assert r.json[0]["sampling_params"] == rec["body"][0]["sampling_params"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", r.json[0]["request_id"])
    bad = DENSE["render"]["completions_render_batch"]
    r = await post(session, tiny_llama.url + "/v1/completions/render", bad["request"])
    assert (r.status, r.json) == (bad["status"], bad["body"])
