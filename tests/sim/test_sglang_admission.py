"""The SGLang simulator's scheduler admission against SGLang 0.5.23 (``rollout_grpc/sim/sglang/
admission.py``; docs/sglang-http-api.md §2.1, §2.2, §3.5, §7): the budget stops two tokens short of
the context, and a prompt within six tokens of it, a ``logprob_start_len`` past the prompt or a
``routed_experts_start_len`` out of range is refused by the scheduler — a 400 ``{"error":
{"message"}}`` when not streaming, the stream's only chunk (an abort with ``status_code`` 400 over
the one-token stub) when streaming. Over real HTTP; each message is 0.5.23's text.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.support import sglang_shapes as S
from tests.support.sglang_http import body, generate, sglang_engine
from tests.support.sim_http import PROMPT, Reply

#: The prompt is 20 tokens; with this context the scheduler admits it and caps its budget at 8.
CONTEXT = 30
#: With a context of 25 the scheduler's longest prompt is 25 - 1 - 5 = 19 (tokenizer: up to 24).
INPUT_TOO_LONG = (
    "Input length (20 tokens) exceeds the maximum allowed length (19 tokens). "
    "Use a shorter input or enable --allow-auto-truncate."
)
ROUTED_TOO_HIGH = (
    "recv_req.routed_experts_start_len=21 is higher than the number of input tokens "
    "len(req.origin_input_ids)=20. Please use a smaller routed_experts_start_len."
)
LOGPROB_TOO_HIGH = (
    "req.logprob_start_len=25 is higher than the number of input tokens "
    "len(req.origin_input_ids)=20. Please use a smaller logprob_start_len."
)


@pytest.mark.parametrize("max_new_tokens", [None, 8])
async def test_the_budget_stops_two_tokens_short_of_the_context(
    session: aiohttp.ClientSession, max_new_tokens: int | None
) -> None:
    """``min(max_new_tokens or 1 << 30, max_req_len - prompt - 1)`` with ``max_req_len`` the context
    minus one (SCH 2693-2716): 8 here, for a null budget and for 10, the largest the tokenizer
    admits (prompt + budget <= context); ``finish_reason.length`` reports the capped value."""
    async with sglang_engine(max_model_len=CONTEXT, eos_probability=0.0) as eng:
        r = await generate(session, eng.url, body("b", 10 if max_new_tokens else None))
    meta = r.json["meta_info"]
    assert r.status == 200 and meta["completion_tokens"] == CONTEXT - len(PROMPT) - 2 == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}


def _cases() -> list[Any]:
    return [
        pytest.param({"max_model_len": 25}, {}, INPUT_TOO_LONG, id="input-length"),
        pytest.param(
            {"max_model_len": 64, "return_routed_experts": True},
            {"return_routed_experts": True, "routed_experts_start_len": 21},
            ROUTED_TOO_HIGH,
            id="routed-start",
        ),
        pytest.param({"max_model_len": 64}, {"logprob_start_len": 25}, LOGPROB_TOO_HIGH, id="logprob-start"),
    ]


@pytest.mark.parametrize(("engine", "extra", "message"), _cases())
async def test_a_refusal_of_the_scheduler_is_a_400_when_not_streaming(
    session: aiohttp.ClientSession, engine: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    async with sglang_engine(**engine) as eng:
        r = await generate(session, eng.url, body("r", 2, **extra))
    assert (r.status, r.json) == (400, {"error": {"message": message}})


@pytest.mark.parametrize(("engine", "extra", "message"), _cases())
async def test_a_refusal_of_the_scheduler_ends_a_stream_with_a_400_abort_chunk(
    session: aiohttp.ClientSession, engine: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    """The tokenizer yields the abort output as a normal chunk (TM 1922): 200, one chunk whose
    ``finish_reason`` is ``FINISH_ABORT(message, 400, "BadRequestError")``, then ``[DONE]``. The
    stub prompt is one token (``set_finish_with_abort``) and takes one forward pass."""
    async with sglang_engine(**engine) as eng:
        r = await generate(session, eng.url, body("r", 2, stream=True, **extra))
    chunk = _only_chunk(r)
    meta = chunk["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": message,
        "status_code": 400,
        "err_type": "BadRequestError",
    }
    assert meta["prompt_tokens"] == 1 and meta["completion_tokens"] == len(chunk["output_ids"]) == 1
    assert S.OUTPUT.problems(chunk) == [] and S.META_INFO.problems(meta) == []
    assert "response_sent_to_client_ts" in meta and "input_token_logprobs" not in meta


def _only_chunk(r: Reply) -> dict[str, Any]:
    assert r.status == 200 and (r.content_type or "").startswith("text/event-stream"), r.raw[:200]
    *chunks, done = r.events
    assert done == "[DONE]" and len(chunks) == 1, r.events
    chunk = chunks[0]
    assert isinstance(chunk, dict)
    return chunk


@pytest.mark.parametrize(("context", "admitted"), [(26, False), (27, True)])
async def test_server_info_reports_the_limit_the_scheduler_refuses_at(
    session: aiohttp.ClientSession, context: int, admitted: bool
) -> None:
    """``max_req_input_len`` in ``/server_info`` (the scheduler's info, SCH 1946) is the context
    minus 6, and a prompt of that many tokens is the first one refused."""
    async with sglang_engine(max_model_len=context) as eng:
        async with session.get(eng.url + "/server_info") as info:
            limit = (await info.json())["max_req_input_len"]
        r = await generate(session, eng.url, body("p", 1))
    assert limit == context - 6
    assert (r.status == 200) is admitted and (len(PROMPT) < limit) is admitted
