"""The engine boundary: only the vLLM adapter knows vLLM's wire format, and it parses it strictly."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import grimp
import numpy as np
import orjson
import pytest

from rollout_grpc.server.domain.model import SamplingParams
from rollout_grpc.server.engines.api import (
    EngineCall,
    EngineDelta,
    EngineFinal,
    EngineMalformed,
    EngineRejected,
    EngineRequestFailed,
    FinishKind,
)
from rollout_grpc.server.engines.vllm import adapter as vllm

SERVER = Path(vllm.__file__).parents[2]
#: vLLM wire-format keys that must appear as string literals only in the adapter (our own proto
#: shares some words, e.g. `stop_reason`, so these are vLLM-only names, matched exactly) ...
VLLM_KEYS = frozenset(
    {
        "choices",
        "token_ids",
        "finish_reason",
        "logprobs",
        "prompt_tokens_details",
        "cached_tokens",
        "mm_hashes",
        "mm_placeholders",
        "vllm_config",
        "routed_experts_prompt_start",
        "stream_interval",
        "max_tokens",
    }
)
#: ... and vLLM paths and id prefixes, matched as substrings.
VLLM_FRAGMENTS = ("generate-tokens-", "/inference/", "/server_info", "/pause", "/render")


#: Modules allowed to name vLLM's wire format, and why.
ALLOWED: dict[str, str] = {
    "engines/vllm/": "the vLLM adapter",
    "engines/sglang/": "the SGLang adapter (SGLang shares some key names with vLLM)",
    "front/openai/": "speaks OpenAI's chat-completions format to harnesses (its keys are OpenAI's)",
}


def _checked_modules() -> list[str]:
    paths = (p.relative_to(SERVER).as_posix() for p in SERVER.rglob("*.py"))
    return sorted(p for p in paths if not p.startswith(tuple(ALLOWED)))


@pytest.mark.parametrize("path", _checked_modules())
def test_no_module_but_the_adapter_knows_vllm_json(path: str) -> None:
    text = (SERVER / path).read_text()
    literals = {lit for pair in re.findall(r"\"([^\"\n]*)\"|'([^'\n]*)'", text) for lit in pair if lit}
    found = (literals & VLLM_KEYS) | {f for f in VLLM_FRAGMENTS for lit in literals if f in lit}
    if path == "domain/params.py":
        # The knob table maps engine error params back to our fields, by the engine-side names.
        found -= {"max_tokens", "logprobs"}
    if path == "rewards/graders/slime_hub.py":
        found -= {"choices"}  # slime's gpqa metadata key (the options of a question), not vLLM's
    assert not found, f"{path} contains vLLM wire keys {sorted(found)}: move them into vllm.py"


@pytest.mark.parametrize("kind", ["rollout_grpc.server.engines.vllm", "rollout_grpc.server.engines.sglang"])
def test_only_the_registry_imports_an_engine_kind(kind: str) -> None:
    """Import-level: ids, routes, capability facts, the chat-render body and R3 decoding live in the
    adapter, so nothing of the server but the registry may import an engine kind at all."""
    graph = grimp.build_graph("rollout_grpc", cache_dir=None)
    inside = {kind, *graph.find_descendants(kind)}
    importers = {
        importer
        for module in inside
        for importer in graph.find_modules_that_directly_import(module)
        if importer not in inside
    }
    assert importers == {"rollout_grpc.server.engines.registry"}


def test_engine_request_ids_are_the_call_id_with_vllms_prefix() -> None:
    assert vllm.engine_request_id("0a1b.c2d3~abc~2~") == "generate-tokens-0a1b.c2d3~abc~2~"


CALL = EngineCall("r", 0, [1, 2], SamplingParams(), None, 0)
CALL_R3 = EngineCall("r", 0, [1, 2], SamplingParams(), None, 0, return_routed_experts=True)


def chunk(**choice: object) -> bytes:
    base: dict[str, object] = {
        "index": 0,
        "finish_reason": None,
        "stop_reason": None,
        "token_ids": [5],
        "routed_experts": None,
        "weight_versions": None,
        "logprobs": {"content": [{"token_id": 5, "logprob": -0.25, "rank": 1, "top_logprobs": []}]},
    }
    base.update(choice)
    return orjson.dumps({"request_id": "x", "usage": None, "choices": [base]})


def test_a_token_chunk_becomes_a_delta() -> None:
    (delta,) = vllm.parse_chunk("u", chunk(), CALL)
    assert delta == EngineDelta([5], [-0.25], None, "")


def test_a_final_chunk_yields_its_delta_then_the_result() -> None:
    arr = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    buf = io.BytesIO()
    np.save(buf, arr)
    spans = [{"version": "v2", "start": 0, "end": 1}]
    events = vllm.parse_chunk(
        "u",
        chunk(
            finish_reason="length",
            weight_versions=spans,
            routed_experts=base64.b64encode(buf.getvalue()).decode(),
        ),
        CALL_R3,
    )
    assert isinstance(events[0], EngineDelta) and isinstance(events[1], EngineFinal)
    assert events[1].finish is FinishKind.LENGTH and events[1].weight_spans[0].version == "v2"
    assert events[1].routed_experts is not None and (events[1].routed_experts == arr).all()


def test_usage_chunk() -> None:
    body = {
        "request_id": "x",
        "usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}},
        "choices": [],
    }
    (usage,) = vllm.parse_chunk("u", orjson.dumps(body), CALL)
    assert usage.cached_tokens == 1  # type: ignore[union-attr]


def _lps(n: int) -> dict[str, object]:
    return {"content": [{"logprob": -0.5} for _ in range(n)]}


def test_token_ids_and_logprobs_of_a_chunk_keep_their_values() -> None:
    """Several tokens, an integer logprob (JSON `0`) read as a float, a chunk of no tokens."""
    logprobs = {"content": [{"logprob": -0.5}, {"logprob": 0}, {"logprob": -1.25}]}
    (delta,) = vllm.parse_chunk("u", chunk(token_ids=[0, 7, 9], logprobs=logprobs), CALL)
    assert delta == EngineDelta([0, 7, 9], [-0.5, 0.0, -1.25], None, "")
    assert all(type(x) is float for x in delta.logprobs)
    empty = vllm.parse_chunk("u", chunk(token_ids=[], logprobs={"content": []}), CALL)
    assert empty == [EngineDelta([], [], None, "")]


MALFORMED = {
    "invalid json": b'{"request_id": "x", "choices": [',
    "array chunk": b"[1, 2, 3]",
    "missing logprob": chunk(logprobs={"content": [{"token_id": 5}]}),
    "string token ids": chunk(token_ids=["5"]),
    "negative token ids": chunk(token_ids=[-3]),
    "bool token id": chunk(token_ids=[True]),
    "string logprob": chunk(logprobs={"content": [{"logprob": "-0.1"}]}),
    # One bad value among good ones (the checks are whole-list C loops, not a test per token).
    "a bool among token ids": chunk(token_ids=[5, 6, True], logprobs=_lps(3)),
    "a negative among token ids": chunk(token_ids=[5, -1, 6], logprobs=_lps(3)),
    "a float among token ids": chunk(token_ids=[5, 6.0], logprobs=_lps(2)),
    "a string among logprobs": chunk(
        token_ids=[5, 6], logprobs={"content": [{"logprob": -0.1}, {"logprob": "-0.2"}]}
    ),
    "a null logprob": chunk(token_ids=[5, 6], logprobs={"content": [{"logprob": -0.1}, {"logprob": None}]}),
    "a logprob entry not an object": chunk(token_ids=[5, 6], logprobs={"content": [{"logprob": -0.1}, 7]}),
    "too few logprobs": chunk(token_ids=[5, 6]),
    "non-integer spans": chunk(
        finish_reason="stop", weight_versions=[{"version": "v", "start": "0", "end": 1.5}]
    ),
    "inverted spans": chunk(finish_reason="stop", weight_versions=[{"version": "v", "start": 3, "end": 1}]),
    "routed experts not base64": chunk(finish_reason="stop", routed_experts="%%%"),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_chunks_raise_engine_malformed(data: bytes) -> None:
    with pytest.raises(EngineMalformed):
        vllm.parse_chunk("u", data, CALL_R3)


def test_in_stream_errors_map_like_http_errors() -> None:
    event = {"error": {"message": "m", "type": "BadRequestError", "param": "stop_token_ids", "code": 400}}
    with pytest.raises(EngineRejected) as info:
        vllm.parse_chunk("u", orjson.dumps(event), CALL)
    assert info.value.param == "stop_token_ids"
    event = {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    with pytest.raises(EngineRequestFailed):
        vllm.parse_chunk("u", orjson.dumps(event), CALL)


def test_http_error_params_are_neutral() -> None:
    err = vllm._http_error(
        "u", 400, b'{"error":{"message":"m","type":"Bad Request","param":"body.token_ids","code":400}}'
    )
    assert isinstance(err, EngineRejected) and err.param == "prompt"
    missing = vllm._http_error("u", 404, b'{"error":{"message":"no","param":"model","code":404}}')
    assert isinstance(missing, EngineRejected) and missing.not_found


def test_unknown_finish_reason_counts_as_stop() -> None:
    (_, fin) = vllm.parse_chunk("u", chunk(finish_reason="weird"), CALL)
    assert isinstance(fin, EngineFinal) and fin.finish is FinishKind.STOP
