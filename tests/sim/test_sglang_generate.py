"""The SGLang personality's ``/generate`` over real HTTP: output object and ``meta_info`` shapes,
cumulative and incremental streaming, logprob triples, finish reasons, validation errors, routed
experts and ``image_data`` (``docs/sglang-http-api.md`` §2, §3, §7, §9)."""

from __future__ import annotations

import base64
import io
from typing import Any

import aiohttp
import pytest
from PIL import Image

from rollout_grpc.sim.config import SGLangOptions
from rollout_grpc.sim.vocab import EOS_ID, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from tests.support.sglang_http import body, decode_routed, generate, sglang_engine
from tests.support.sim_http import PROMPT

META_HEAD = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"]
META_LOGPROBS = ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"]
META_COUNTS = ["reasoning_tokens", "completion_tokens", "cached_tokens", "weight_versions"]


async def test_nonstream_object_and_meta_info(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        r = await generate(session, eng.url, body("req-a", 5))
    assert r.status == 200 and r.content_type == "application/json"
    out = r.json
    assert list(out) == ["text", "output_ids", "meta_info"]
    m = out["meta_info"]
    assert list(m) == [
        *META_HEAD,
        *META_LOGPROBS,
        *META_COUNTS,
        "dp_rank",
        "e2e_latency",
        "response_sent_to_client_ts",
    ]
    assert m["id"] == "req-a"  # the client's rid, verbatim
    assert m["finish_reason"] == {"type": "length", "length": 5}
    assert m["prompt_tokens"] == len(PROMPT) and m["completion_tokens"] == 5
    assert m["weight_version"] == "default" and m["num_retractions"] == 0
    assert m["input_token_logprobs"] == []  # logprob_start_len defaults to -1
    assert m["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    triples = m["output_token_logprobs"]
    assert m["output_token_logprobs_length"] == len(triples) == 5
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(isinstance(t[0], float) and t[0] <= 0.0 and t[2] is None for t in triples)
    assert isinstance(out["text"], str) and out["text"]


async def test_rid_defaults_to_uuid_hex_and_text_prompt_is_tokenised(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        r = await generate(
            session, eng.url, {"text": "hello there", "sampling_params": {"max_new_tokens": 2}}
        )
    rid = r.json["meta_info"]["id"]
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert r.json["meta_info"]["prompt_tokens"] == len(eng.core.vocab.encode("hello there"))
    assert "output_token_logprobs" not in r.json["meta_info"]  # return_logprob defaults to false


async def test_max_new_tokens_defaults_to_128(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        r = await generate(session, eng.url, {"input_ids": PROMPT})
    assert r.json["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(r.json["output_ids"]) == 128


async def test_cumulative_stream(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        ref = (await generate(session, eng.url, body("ref", 6))).json
        r = await generate(session, eng.url, body("s", 6, stream=True))
    assert r.status == 200 and r.content_type == "text/event-stream; charset=utf-8"
    events = r.events
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 6  # one output per token at stream_interval 1
    for i, c in enumerate(chunks, start=1):
        m = c["meta_info"]
        assert len(c["output_ids"]) == i and m["completion_tokens"] == i
        assert len(m["output_token_logprobs"]) == m["output_token_logprobs_length"] == i
        assert c["output_ids"] == ref["output_ids"][:i]  # everything so far, every time
        assert ref["text"].startswith(c["text"])
        assert (m["finish_reason"] is None) == (i < 6)
        assert ("e2e_latency" in m) == (i == 6)
        # Spans are computed for finished requests only (0.5.23 output_streamer.py:541-554).
        assert ("weight_versions" in m) == (i == 6)
    assert chunks[-1]["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert chunks[-1]["text"] == ref["text"]
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]


async def test_incremental_stream_sends_deltas_with_cumulative_length(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(SGLangOptions(incremental_streaming_output=True), eos_probability=0.0) as eng:
        ref = (await generate(session, eng.url, body("ref", 6))).json
        r = await generate(session, eng.url, body("s", 6, stream=True))
    chunks = r.events[:-1]
    ids: list[int] = []
    triples: list[Any] = []
    for i, c in enumerate(chunks, start=1):
        assert len(c["output_ids"]) == 1
        ids += c["output_ids"]
        triples += c["meta_info"]["output_token_logprobs"]
        assert c["meta_info"]["output_token_logprobs_length"] == i  # cumulative in both modes
    assert ids == ref["output_ids"] and triples == ref["meta_info"]["output_token_logprobs"]
    assert "".join(c["text"] for c in chunks) == ref["text"]


async def test_stream_interval_spaces_chunks(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        r = await generate(session, eng.url, body("s", 7, stream=True, sp={"stream_interval": 3}))
    assert [len(c["output_ids"]) for c in r.events[:-1]] == [1, 4, 7]


async def test_stop_token_finish_matches_the_id(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        ref = (await generate(session, eng.url, body("ref", 8))).json["output_ids"]
        stop = ref[3]
        first = ref.index(stop)
        r = await generate(session, eng.url, body("s", 8, sp={"stop_token_ids": [stop]}))
    out = r.json
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ref[: first + 1]  # the stop token stays in output_ids


async def test_eos_finish_matches_eos_id(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=1.0) as eng:
        r = await generate(session, eng.url, body("s", 8))
    assert r.json["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert r.json["output_ids"] == [EOS_ID]


@pytest.mark.parametrize("no_stop_trim", [False, True])
async def test_stop_string_finish_matches_the_string(
    session: aiohttp.ClientSession, no_stop_trim: bool
) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        ref = (await generate(session, eng.url, body("ref", 12))).json["text"]
        stop = ref[len(ref) // 2 : len(ref) // 2 + 3]
        cut = ref.index(stop)
        sp = {"stop": [stop], "no_stop_trim": no_stop_trim}
        r = await generate(session, eng.url, body("s", 12, sp=sp))
    out = r.json
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == (ref[: cut + len(stop)] if no_stop_trim else ref[:cut])


async def test_logprob_start_len_and_top_logprobs(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        payload = body("s", 3, logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
        r = await generate(session, eng.url, payload)
    m = r.json["meta_info"]
    assert list(m)[5:10] == [*META_LOGPROBS, "input_top_logprobs", "output_top_logprobs"]
    inp = m["input_token_logprobs"]
    assert [t[1] for t in inp] == PROMPT and inp[0][0] is None
    assert all(isinstance(t[0], float) and isinstance(t[2], str) for t in inp[1:])
    assert m["input_top_logprobs"][0] is None and len(m["input_top_logprobs"]) == len(PROMPT)
    for row, chosen in zip(m["output_top_logprobs"], m["output_token_logprobs"], strict=True):
        assert len(row) == 2 and row[0][0] >= row[1][0]
        assert row[0][1] == chosen[1]  # greedy: the chosen token is the best one
        assert chosen[2] == eng.core.vocab.token_str(chosen[1])


async def test_cached_tokens_count_a_repeated_prefix(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        first = (await generate(session, eng.url, body("a", 4))).json
        again = (await generate(session, eng.url, body("b", 4))).json
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(PROMPT) - 1


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("stream", [False, True])
async def test_an_unknown_sampling_key_is_the_contract_gates_bare_string_400(
    session: aiohttp.ClientSession, stream: bool
) -> None:
    """SGLang 0.5.23's contract gate (entrypoints/http_server.py 937-939): 400 ``{"error": "<text>"}``, even
    for a stream (it runs before the stream opens), and nothing starts."""
    async with sglang_engine() as eng:
        payload = {"input_ids": PROMPT, "sampling_params": {"max_tokens": 4}, "stream": stream}
        r = await generate(session, eng.url, payload)
        assert eng.stats.generate_started == 0
    assert r.status == 400 and isinstance(r.json, dict) and set(r.json) == {"error"}
    assert r.json["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`,")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            {"sampling_params": {"max_new_tokens": 2}},
            "Either text, input_ids or input_embeds should be provided.",
        ),
        ({"input_ids": []}, "input_ids cannot be empty."),
        (
            {"input_ids": PROMPT, "sampling_params": {"top_k": 0}},
            "top_k must be -1 (disable) or at least 1, got 0.",
        ),
        (
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}},
            "max_new_tokens must be at least 0, got -1.",
        ),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0.0."),
        (
            {"input_ids": [1, 5000]},
            "The input_ids [1, 5000] contains values greater than the vocab size (2048).",
        ),
    ],
)
async def test_value_errors_are_400_with_the_message(
    session: aiohttp.ClientSession, payload: dict[str, Any], message: str
) -> None:
    async with sglang_engine() as eng:
        r = await generate(session, eng.url, payload)
        assert eng.stats.generate_started == 0
    assert r.status == 400 and r.json == {"error": {"message": message}}


async def test_prompt_at_the_context_length_is_rejected(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(max_model_len=20) as eng:
        r = await generate(session, eng.url, body("s", 2))
    msg = "The input (20 tokens) is longer than the model's context length (20 tokens)."
    assert r.status == 400 and r.json["error"]["message"] == msg


async def test_a_budget_over_the_context_is_refused_not_cut(session: aiohttp.ClientSession) -> None:
    # 0.5.23 managers/tokenizer_manager.py:1353-1378 (vLLM cuts the output at the context instead).
    async with sglang_engine(max_model_len=30, eos_probability=0.0) as eng:
        fits = await generate(session, eng.url, body("fits", 10))
        over = await generate(session, eng.url, body("over", 11))
    # Admitted, then capped by the scheduler two tokens short of the context (test_sglang_admission).
    assert fits.status == 200 and fits.json["meta_info"]["completion_tokens"] == 8
    msg = (
        "Requested token count exceeds the model's maximum context length of 30 tokens. You requested "
        "a total of 31 tokens: 20 tokens from the input messages and 11 tokens for the completion. "
        "Please reduce the number of tokens in the input messages or the completion to fit within the limit."
    )
    assert over.status == 400 and over.json == {"error": {"message": msg}}


async def test_value_error_while_streaming_is_an_error_event(session: aiohttp.ClientSession) -> None:
    async with sglang_engine() as eng:
        r = await generate(session, eng.url, body("s", 2, stream=True, sp={"top_k": 0}))
    assert r.status == 200
    err, done = r.events
    assert "top_k" in err["error"]["message"] and done == "[DONE]"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"input_ids": "1 2 3"}, "input_ids"),
        ({"input_ids": PROMPT, "stream": "yes"}, "stream"),
        ({"text": 5}, "text"),
    ],
)
async def test_type_errors_use_the_flat_envelope_naming_the_field(
    session: aiohttp.ClientSession, payload: dict[str, Any], field: str
) -> None:
    async with sglang_engine() as eng:
        r = await generate(session, eng.url, payload)
    assert r.status == 400
    err = r.json
    assert list(err) == ["object", "message", "type", "param", "code"]
    assert err["object"] == "error" and err["type"] == "Bad Request" and err["code"] == 400
    assert f"body.{field}" in err["message"]


async def test_unknown_top_level_keys_are_ignored(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        r = await generate(session, eng.url, {**body("s", 2), "not_a_field": 1})
    assert r.status == 200


# ---------------------------------------------------------------------------- routed experts


async def test_routed_experts_raw_int32_rows_and_start(session: aiohttp.ClientSession) -> None:
    cfg: dict[str, Any] = {
        "eos_probability": 0.0,
        "return_routed_experts": True,
        "moe_layers": 3,
        "moe_experts": 8,
        "moe_topk": 2,
    }
    async with sglang_engine(**cfg) as eng:
        full = (await generate(session, eng.url, body("a", 5, return_routed_experts=True))).json
        tail = (
            await generate(
                session, eng.url, body("b", 5, return_routed_experts=True, routed_experts_start_len=7)
            )
        ).json
        without = (await generate(session, eng.url, body("c", 5))).json
    assert list(full["meta_info"])[-4:] == [
        "routed_experts",
        "dp_rank",
        "e2e_latency",
        "response_sent_to_client_ts",
    ]
    rows = decode_routed(full["meta_info"]["routed_experts"], 3, 2)
    assert rows.shape == (len(PROMPT) + 5 - 1, 3, 2)
    assert ((rows >= 0) & (rows < 8)).all()
    assert all(len(set(r.tolist())) == 2 for r in rows.reshape(-1, 2))  # top-k experts are distinct
    assert (decode_routed(tail["meta_info"]["routed_experts"], 3, 2) == rows[7:]).all()
    assert "routed_experts" not in without["meta_info"]  # the request flag is needed too


async def test_routed_experts_need_the_server_flag(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        r = await generate(session, eng.url, body("a", 3, return_routed_experts=True))
        async with session.get(eng.url + "/server_info") as info:
            assert info.status == 200
            assert (await info.json())["enable_return_routed_experts"] is False
    assert "routed_experts" not in r.json["meta_info"]


async def test_routed_experts_start_out_of_range(session: aiohttp.ClientSession) -> None:
    """The scheduler's refusal (SCH 3300-3319), a 400 ``ValueError`` when not streaming
    (test_sglang_admission has the stream)."""
    async with sglang_engine(return_routed_experts=True) as eng:
        r = await generate(
            session, eng.url, body("a", 3, return_routed_experts=True, routed_experts_start_len=21)
        )
    msg = (
        "recv_req.routed_experts_start_len=21 is higher than the number of input tokens "
        "len(req.origin_input_ids)=20. Please use a smaller routed_experts_start_len."
    )
    assert r.status == 400 and r.json == {"error": {"message": msg}}


# ---------------------------------------------------------------------------- image_data


def _png(color: tuple[int, int, int], size: int = 56) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


VL_PROMPT = [1, 300, VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID, 400, 500]


async def test_image_data_expands_the_placeholder_and_changes_the_output(
    session: aiohttp.ClientSession,
) -> None:
    async with sglang_engine(eos_probability=0.0, multimodal=True) as eng:
        outs = []
        for color in ((255, 0, 0), (0, 0, 255)):
            payload = {**body("img", 6), "input_ids": VL_PROMPT, "image_data": [_png(color)]}
            payload["return_prompt_token_ids"] = True
            r = await generate(session, eng.url, payload)
            assert r.status == 200
            outs.append(r.json)
        bare = {**body("b64", 6), "input_ids": VL_PROMPT, "image_data": _png((255, 0, 0)).split(",", 1)[1]}
        same = (await generate(session, eng.url, bare)).json
    m = outs[0]["meta_info"]
    assert m["image_tokens"] == 4  # a 56x56 image is 4 placeholder tokens
    assert m["prompt_tokens"] == len(VL_PROMPT) - 1 + 4
    assert outs[0]["prompt_token_ids"].count(IMAGE_PAD_ID) == 4
    assert outs[0]["output_ids"] != outs[1]["output_ids"]
    assert same["output_ids"] == outs[0]["output_ids"]  # a bare base64 string is the same image


@pytest.mark.parametrize(
    ("multimodal", "prompt", "images", "fragment"),
    [
        (False, VL_PROMPT, 1, "not a multimodal model"),
        (True, [1, 300, 400], 1, "image placeholder"),
        (
            True,
            [1, IMAGE_PAD_ID, IMAGE_PAD_ID, IMAGE_PAD_ID],
            3,
            "Image count 3 exceeds limit 2 per request.",
        ),
    ],
)
async def test_image_data_errors(
    session: aiohttp.ClientSession, multimodal: bool, prompt: list[int], images: int, fragment: str
) -> None:
    async with sglang_engine(multimodal=multimodal) as eng:
        payload = {**body("img", 2), "input_ids": prompt, "image_data": [_png((9, 9, 9))] * images}
        r = await generate(session, eng.url, payload)
    assert r.status == 400 and fragment in r.json["error"]["message"]
