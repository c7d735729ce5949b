"""Sampling-parameter validation and translation to vLLM."""

from __future__ import annotations

import math

import pytest

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain import params
from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.model import SamplingParams
from rollout_grpc.server.engines.api import EngineCall
from rollout_grpc.server.engines.vllm.adapter import sampling_params
from rollout_grpc.server.front.grpc import convert


def to_vllm(p: SamplingParams, *, max_tokens: int | None, min_tokens: int) -> dict[str, object]:
    """The vLLM sampling_params of one call of `p` (the adapter's translation of the knob table)."""
    call = EngineCall("r", 0, [1], p, max_tokens, min_tokens, top_logprobs=p.top_logprobs or 0)
    return sampling_params(call)


def test_rollout_defaults_follow_slime() -> None:
    sp = to_vllm(SamplingParams(), max_tokens=None, min_tokens=0)
    assert sp == {
        "logprobs": 0,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }


def test_nothing_is_dropped() -> None:
    p = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=3,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.1,
        ignore_eos=True,
        stop=["x"],
        stop_token_ids=[5],
        logit_bias={7: 1.5},
        no_stop_trim=False,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        top_logprobs=3,
    )
    sp = to_vllm(p, max_tokens=9, min_tokens=2)
    assert sp["max_tokens"] == 9 and sp["min_tokens"] == 2 and sp["logprobs"] == 3
    assert sp["top_k"] == 20 and sp["logit_bias"] == {"7": 1.5} and sp["include_stop_str_in_output"] is False
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
    ):
        assert sp[name] == getattr(p, name)


def test_top_k_off_is_not_sent() -> None:
    assert "top_k" not in to_vllm(SamplingParams(top_k=0), max_tokens=1, min_tokens=0)
    assert to_vllm(SamplingParams(top_k=-1), max_tokens=1, min_tokens=0)["top_k"] == -1


@pytest.mark.parametrize(
    ("p", "field"),
    [
        (SamplingParams(temperature=-1), "sampling_params.temperature"),
        (SamplingParams(temperature=math.nan), "sampling_params.temperature"),
        (SamplingParams(top_p=0), "sampling_params.top_p"),
        (SamplingParams(top_p=1.5), "sampling_params.top_p"),
        (SamplingParams(top_k=-2), "sampling_params.top_k"),
        (SamplingParams(min_p=2), "sampling_params.min_p"),
        (SamplingParams(max_new_tokens=0), "sampling_params.max_new_tokens"),
        (SamplingParams(min_new_tokens=5, max_new_tokens=3), "sampling_params.min_new_tokens"),
        (SamplingParams(repetition_penalty=0), "sampling_params.repetition_penalty"),
        (SamplingParams(presence_penalty=3), "sampling_params.presence_penalty"),
        (SamplingParams(stop_token_ids=[1, -1]), "sampling_params.stop_token_ids[1]"),
        (SamplingParams(stop=[""]), "sampling_params.stop[0]"),
        (SamplingParams(top_logprobs=21), "sampling_params.top_logprobs"),
    ],
)
def test_invalid_values_name_the_field(p: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        params.validate(p, skip_text=True)
    assert info.value.field == field


def test_top_logprobs_need_tokens_mode() -> None:
    with pytest.raises(InvalidArgument, match="skip_text"):
        params.validate(SamplingParams(top_logprobs=2), skip_text=False)
    params.validate(SamplingParams(top_logprobs=2), skip_text=True)


#: SamplingParams proto fields deliberately not in the knob table (none today).
EXCLUDED: frozenset[str] = frozenset()


def test_every_proto_knob_is_in_the_table() -> None:
    """A new SamplingParams field fails here until it has a row in params.KNOBS (or is excluded)."""
    proto_fields = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    table = {k.name for k in params.KNOBS}
    assert proto_fields - EXCLUDED == table, (proto_fields - table, table - proto_fields)
    assert set(SamplingParams.__dataclass_fields__) == table


def test_every_engine_knob_is_translated_and_maps_back_to_its_field() -> None:
    """Each knob with an engine name is sent when set, and the engine's `param` names our field."""
    for knob in params.KNOBS:
        if knob.engine is None:
            continue
        assert params.field_for_engine_param(knob.engine, "x") == "sampling_params." + knob.name


def test_proto_conversion_walks_the_table() -> None:
    msg = pb.SamplingParams(temperature=0.5, stop=["a"], logit_bias={3: 1.0}, top_logprobs=2)
    got = convert.sampling_params_from_pb(msg)
    assert got == SamplingParams(temperature=0.5, stop=["a"], logit_bias={3: 1.0}, top_logprobs=2)


@pytest.mark.parametrize(
    ("param", "field"),
    [
        ("max_tokens", "sampling_params.max_new_tokens"),
        ("logprobs", "sampling_params.top_logprobs"),
        ("stop_token_ids", "sampling_params.stop_token_ids"),
        ("include_stop_str_in_output", "sampling_params.no_stop_trim"),
        ("prompt", "sample.tokens"),
        (None, "sample.tokens"),
        ("something_new", "sample.tokens"),
    ],
)
def test_engine_params_map_to_our_fields(param: str | None, field: str) -> None:
    assert params.field_for_engine_param(param, "sample.tokens") == field
