"""The SGLang simulator's JSON contract gate over ``sampling_params`` against SGLang 0.5.23
(``rollout_grpc/sim/sglang/contract.py``; docs/sglang-http-api.md §2.2, §7): the first unknown key
or wrongly typed value, in the body's order, is a 400 with the bare-string envelope and serde's text
(which names no key for a type), streaming or not, before ``verify``. Over real HTTP; the field list
is checked against the unpacked wheel when it is there.
"""

from __future__ import annotations

import ast
from typing import Any

import aiohttp
import pytest

from rollout_grpc.sim.sglang.contract import CONTRACT_FIELDS
from rollout_grpc.sim.sglang.params import KNOWN
from tests.support.sglang_citations import SOURCE
from tests.support.sglang_http import body, generate, sglang_engine

API_TYPES = SOURCE / "sglang/api/v1/api_types.py"


@pytest.mark.parametrize(
    ("sp", "message"),
    [
        ({"temperature": "hot"}, 'invalid type: string "hot", expected f64'),
        ({"max_new_tokens": 1.5}, "invalid type: floating point `1.5`, expected i64"),
        ({"top_k": True}, "invalid type: boolean `true`, expected i64"),
        ({"ignore_eos": 1}, "invalid type: integer `1`, expected a boolean"),
        ({"stop": 3}, "invalid type: integer `3`, expected a value or an array of values for StringOrList"),
        ({"stop": ["a", 2]}, "invalid type: integer `2`, expected a string"),
        ({"stop_token_ids": 5}, "invalid type: integer `5`, expected a sequence"),
        ({"stop_token_ids": [1, None]}, "invalid type: null, expected i64"),
        ({"logit_bias": {"5": "x"}}, 'invalid type: string "x", expected f64'),
        ({"logit_bias": [1]}, "invalid type: sequence, expected a map"),
        ({"top_p": "x", "bogus": 1}, 'invalid type: string "x", expected f64'),
        ({"bogus": 1, "top_p": "x"}, "unknown field `bogus`, expected one of `max_new_tokens`"),
        ({"regex": 5}, "invalid type: integer `5`, expected a string"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_gate_refuses_the_first_bad_key_in_body_order(
    session: aiohttp.ClientSession, sp: dict[str, Any], message: str, stream: bool
) -> None:
    async with sglang_engine() as eng:
        r = await generate(session, eng.url, body("g", 4, stream=stream, sp=sp))
        assert eng.core.stats.generate_requests == 1 and not eng.core.tracked()
    assert r.status == 400 and isinstance(r.json["error"], str), r.raw[:200]
    assert r.json["error"].startswith(message), r.json


async def test_null_is_every_fields_default_at_the_gate(session: aiohttp.ClientSession) -> None:
    async with sglang_engine(eos_probability=0.0) as eng:
        r = await generate(
            session, eng.url, body("n", 3, sp={"temperature": None, "stop": None, "top_k": None})
        )
    assert r.status == 200 and r.json["meta_info"]["completion_tokens"] == 3


def test_the_fields_are_the_contracts() -> None:
    """The simulator knows exactly the gate's fields, in the wheel's order where it is unpacked."""
    assert set(CONTRACT_FIELDS) == KNOWN and len(CONTRACT_FIELDS) == len(set(CONTRACT_FIELDS))
    if not API_TYPES.is_file():
        pytest.skip(f"no unpacked sglang 0.5.23 source at {SOURCE}: run tools/sglang/fetch_source.sh")
    tree = ast.parse(API_TYPES.read_text(encoding="utf-8"))
    wheel = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "_FIELDS_SamplingParams" for t in node.targets)
    )
    assert tuple(wheel) == CONTRACT_FIELDS
