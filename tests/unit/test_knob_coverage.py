"""Every sampling knob of the table (`domain/params.KNOBS`) reaches every door and every engine.

A new knob is the proto, the domain dataclass and one row of the table; this test then fails until
it has a test value here and reaches the gRPC door, the OpenAI door (through the table's alias
column, or an entry of `NOT_OFFERED` saying why not), the slime hook, and both simulators through
the real adapters' translation (a knob the simulator would ignore would make it lie about the
engine).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.integrations import slime
from rollout_grpc.server.domain import params
from rollout_grpc.server.domain.model import SamplingParams
from rollout_grpc.server.engines.api import EngineCall
from rollout_grpc.server.engines.sglang import wire as sglang_wire
from rollout_grpc.server.engines.vllm.adapter import sampling_params as vllm_sampling_params
from rollout_grpc.server.front.grpc import convert
from rollout_grpc.server.front.openai import protocol
from rollout_grpc.sim import params as vllm_sim
from rollout_grpc.sim.sglang import params as sglang_sim

#: A set value of every knob, different from every default (domain, OpenAI, slime, engines).
SET: dict[str, Any] = {
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 3,
    "min_p": 0.1,
    "max_new_tokens": 7,
    "min_new_tokens": 2,
    "stop": ["x"],
    "stop_token_ids": [5],
    "ignore_eos": True,
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "spaces_between_special_tokens": True,
    "seed": 3,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.2,
    "frequency_penalty": 0.1,
    "logit_bias": {7: 1.5},
    "top_logprobs": 2,
}
#: Knobs OpenAI's default already sets to the value above (it cannot show a change there).
OPENAI_SAME_AS_DEFAULT = {"skip_special_tokens"}
#: Knobs slime never sends, with the reason (slime asks for the sampled token's logprob only).
NOT_FROM_SLIME = {"top_logprobs": "slime's rollout asks for the sampled token's logprob, never top-k"}
#: Knobs sent outside SGLang's `sampling_params` object.
NOT_IN_SGLANG_SAMPLING = {"top_logprobs": "sent as the request's top_logprobs_num"}

KNOBS = [k.name for k in params.KNOBS]


def test_every_knob_has_a_test_value() -> None:
    assert set(SET) == set(KNOBS)


@pytest.mark.parametrize("name", KNOBS)
def test_the_grpc_door_reads_the_knob(name: str) -> None:
    value = SET[name]
    got = convert.sampling_params_from_pb(pb.SamplingParams(**{name: value}))
    assert getattr(got, name) == pytest.approx(value)


@pytest.mark.parametrize("name", KNOBS)
def test_the_openai_door_reads_the_knob_through_the_alias_column(name: str) -> None:
    knob = next(k for k in params.KNOBS if k.name == name)
    if not knob.openai:
        assert name in protocol.NOT_OFFERED, f"{name}: give it an OpenAI alias or a NOT_OFFERED reason"
        return
    assert name not in protocol.NOT_OFFERED
    value = SET[name]
    json_value = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
    for alias in knob.openai:
        got = protocol.sampling_params({alias: json_value})
        assert getattr(got, name) == pytest.approx(value), alias
        if name not in OPENAI_SAME_AS_DEFAULT:
            assert getattr(protocol.sampling_params({}), name) != getattr(got, name)
    # An error on the knob's field names the OpenAI spelling.
    assert params.openai_name("sampling_params." + name) == knob.openai[0]


@pytest.mark.parametrize("name", KNOBS)
def test_the_slime_hook_sends_the_knob(name: str) -> None:
    keys = [key for key, field in slime.PARAM_NAMES.items() if field == name]
    if not keys:
        assert name in NOT_FROM_SLIME, f"{name}: map a slime key to it in integrations/slime.PARAM_NAMES"
        return
    for key in keys:
        message = slime.translate_sampling_params({key: SET[name]})
        got = convert.sampling_params_from_pb(message)
        assert getattr(got, name) == pytest.approx(SET[name]), key


def _call(p: SamplingParams) -> EngineCall:
    return EngineCall(
        "r", 0, [1, 2], p, p.max_new_tokens, p.min_new_tokens or 0, top_logprobs=p.top_logprobs or 0
    )


@pytest.mark.parametrize("name", KNOBS)
def test_the_vllm_simulator_honours_the_knob(name: str) -> None:
    base = SamplingParams(max_new_tokens=20)
    changed = replace(base, **{name: SET[name]})
    parse = vllm_sim.parse_sampling_params
    assert parse(vllm_sampling_params(_call(changed))) != parse(vllm_sampling_params(_call(base)))


@pytest.mark.parametrize("name", KNOBS)
def test_the_sglang_simulator_honours_the_knob(name: str) -> None:
    if name in NOT_IN_SGLANG_SAMPLING:
        return
    base = SamplingParams(max_new_tokens=20)
    changed = replace(base, **{name: SET[name]})
    parse = sglang_sim.parse_sampling_params
    translate = sglang_wire.sampling_params
    assert parse(translate(_call(changed)), 1000) != parse(translate(_call(base)), 1000)
