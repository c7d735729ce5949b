"""The toy vocabulary and the `python -m rollout_grpc.sim` and `tests.support.sim_server` entry points."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest

from rollout_grpc.sim.vocab import EOS_ID, IMAGE_PAD_ID, SPECIAL_TOKENS, IncrementalDecoder, Vocab, get_vocab
from tests.support.processes import Processes, start_engine
from tests.support.sim_http import PROMPT, gen_body, generate, get, post


def test_special_ids_and_size() -> None:
    v = get_vocab(2048)
    assert v.size == len(v.token_bytes) == 2048
    assert SPECIAL_TOKENS[EOS_ID] == "<|im_end|>" and SPECIAL_TOKENS[IMAGE_PAD_ID] == "<|image_pad|>"
    assert len(set(v.token_bytes)) == 2048  # every id decodes to distinct bytes
    assert Vocab(300).size == 300
    with pytest.raises(ValueError):
        Vocab(100)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
        "naïve café \u2013 ünïcödé 🎉",
        "def f(x):\n    return x + 1\n",
        "<|not special|> <| >",
        "",
    ],
)
def test_encode_decode_round_trip(text: str) -> None:
    v = get_vocab(2048)
    ids = v.encode(text)
    assert v.decode(ids) == text
    assert all(0 <= i < 2048 for i in ids)


def test_greedy_longest_match_uses_pieces() -> None:
    v = get_vocab(2048)
    ids = v.encode(" the world")
    assert len(ids) == 2
    assert v.encode("<|im_end|>") == [EOS_ID]


def test_skip_special_tokens() -> None:
    v = get_vocab(2048)
    ids = v.encode("<|im_start|>hi<|im_end|>")
    assert v.decode(ids, skip_special_tokens=True) == "hi"
    dec = IncrementalDecoder(v, skip_special_tokens=True)
    assert "".join(dec.add(i) for i in ids) == "hi"


def test_incremental_decoder_holds_partial_utf8() -> None:
    """DecodeStream semantics, as observed on vLLM: split characters appear once complete,
    lone continuation bytes never appear, an invalid byte inside the text becomes U+FFFD."""
    v = get_vocab(2048)
    raw = "é".encode()
    dec = IncrementalDecoder(v, skip_special_tokens=False)
    assert dec.add(8 + raw[0]) == ""
    assert dec.add(8 + raw[1]) == "é"
    lone = IncrementalDecoder(v, skip_special_tokens=False)
    assert lone.add(8 + 0xA0) + lone.add(8 + 0xA0) == "" and lone.text == ""
    mid = IncrementalDecoder(v, skip_special_tokens=False)
    assert "".join(mid.add(t) for t in [8 + 0xA0, *v.encode(" one")]) == "\ufffd one"
    assert v.token_str(8 + 0xA0) == "" and v.token_str(8 + ord("a")) == "a"


async def test_cli_port_file(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rollout_grpc.sim",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--model",
        "cli-model",
        "--token-delay-ms",
        "0",
        "--moe",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = await proc.stderr.readline()  # printed once the socket listens and the file exists
        assert b"serving cli-model" in line
        port = int(port_file.read_text())
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            assert (await get(s, url + "/health")).status == 200
            r = await generate(s, url, {**gen_body(max_tokens=3), "model": "cli-model"})
            assert r.status == 200 and isinstance(r.json["choices"][0]["routed_experts"], str)
            assert len(PROMPT) == r.json["usage"]["prompt_tokens"]
    finally:
        proc.terminate()
        assert await proc.wait() == 0


async def test_test_routes_only_on_the_test_launcher(tmp_path: Path) -> None:
    """`python -m tests.support.sim_server` serves `/_sim/*` in its own process; the package's
    entry point does not: faults of a subprocess engine are switched over HTTP from the test side."""
    with Processes(tmp_path) as procs:
        plain = start_engine(procs, "plain", token_delay_ms=0)
        tested = start_engine(procs, "tested", token_delay_ms=0, test_routes=True)
        async with aiohttp.ClientSession() as s:
            assert (await get(s, plain.url + "/_sim/faults")).status == 404
            assert (await post(s, tested.url + "/_sim/faults", {"http_500": 1})).json["http_500"] == 1
            assert (await generate(s, tested.url, gen_body(max_tokens=2))).status == 500
            assert (await generate(s, tested.url, gen_body(max_tokens=2))).status == 200
            assert (await get(s, tested.url + "/_sim/stats")).json["generate_requests"] == 2
