"""Sampling params as a dict: one parser for both clients and the slime hook, errors in snake_case."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout_grpc.client import AsyncRolloutClient, RolloutClient, pb
from rollout_grpc.client.params import SETTERS, sampling_params
from rollout_grpc.integrations import slime

PROMPT = [1, 92, 510, 206]
NOWHERE = "127.0.0.1:1"  # nothing listens: a ValueError here was raised before any call


def test_every_sampling_field_has_a_setter() -> None:
    assert set(SETTERS) == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def test_a_full_dict_sets_every_field() -> None:
    params = sampling_params(
        {
            "temperature": 0,
            "top_p": np.float32(0.5),
            "top_k": np.int64(4),
            "min_p": 0.1,
            "max_new_tokens": 16,
            "min_new_tokens": 2,
            "stop": "\n\n",
            "stop_token_ids": [2, np.int32(3)],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "no_stop_trim": np.bool_(True),
            "spaces_between_special_tokens": True,
            "seed": 2**40,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "logit_bias": {"7": -1, 9: 2.5},
            "top_logprobs": 3,
        }
    )
    assert params.HasField("temperature") and params.temperature == 0.0
    assert params.top_k == 4 and params.seed == 2**40 and params.top_logprobs == 3
    assert list(params.stop) == ["\n\n"] and list(params.stop_token_ids) == [2, 3]
    assert dict(params.logit_bias) == {7: -1.0, 9: 2.5}
    assert params.no_stop_trim and not params.skip_special_tokens
    assert {f.name for f, _ in params.ListFields()} == set(SETTERS)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"max_tokens": 8}, r"unknown sampling param 'max_tokens'; supported: frequency_penalty, "),
        ({"maxNewTokens": 8}, r"'maxNewTokens' \(did you mean 'max_new_tokens'\?\)"),
        ({"max_new_tokens": "8"}, r"sampling param 'max_new_tokens' has an invalid value '8'"),
        ({"max_new_tokens": 8.0}, r"'max_new_tokens' has an invalid value 8.0"),
        ({"top_k": 2**40}, r"'top_k' has an invalid value"),  # beyond int32
        ({"ignore_eos": 1}, r"'ignore_eos' has an invalid value 1"),
        ({"temperature": "hot"}, r"'temperature' has an invalid value 'hot'"),
        ({"stop": [1]}, r"'stop' has an invalid value \[1\]"),
    ],
)
def test_both_clients_name_a_bad_key_before_calling(given: dict[str, object], message: str) -> None:
    with RolloutClient(NOWHERE) as client, pytest.raises(ValueError, match=message) as err:
        client.generate(PROMPT, given)
    assert "maxNewTokens" not in str(err.value).replace("'maxNewTokens'", "")  # no JSON names listed

    async def run() -> None:
        async with AsyncRolloutClient(NOWHERE) as client:
            with pytest.raises(ValueError, match=message):
                await client.generate(PROMPT, given)

    asyncio.run(run())


def test_the_slime_hook_uses_the_same_parser_with_its_names() -> None:
    assert slime.translate_sampling_params({"sampling_seed": 7}) == pb.SamplingParams(seed=7)
    with pytest.raises(ValueError, match=r"^unknown slime sampling param 'max_tokens'; supported: "):
        slime.translate_sampling_params({"max_tokens": 8})
    with pytest.raises(ValueError, match=r"^slime sampling param 'top_k' has an invalid value 1.5 "):
        slime.translate_sampling_params({"top_k": 1.5})
    with pytest.raises(ValueError, match=r"'sampling_seed' and 'seed' both set seed"):
        slime.translate_sampling_params({"sampling_seed": 1, "seed": 2})
