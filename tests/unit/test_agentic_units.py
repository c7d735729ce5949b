"""Tool-call parsing, trajectory assembly and drift splicing, multi-turn sample helpers (pure)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from rollout_grpc.client import make_sample, pb
from rollout_grpc.client.multiturn import append_observation, turn_params
from rollout_grpc.server.domain.errors import InvalidArgument, ResourceExhausted, Unavailable
from rollout_grpc.server.domain.model import Finish, RoutedExperts, Status, WeightSpan
from rollout_grpc.server.domain.trajectory import Session, Turn, extends, splice, to_samples
from rollout_grpc.server.front.openai.protocol import OpenAIError, finish_reason, from_domain, sampling_params
from rollout_grpc.server.front.openai.tools import HermesToolParser, NoToolParser, get_parser, held_back


def test_hermes_parses_calls_and_the_content_before_them() -> None:
    text = (
        "I will look it up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
    )
    parsed = HermesToolParser().parse(text)
    assert parsed.content == "I will look it up."
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Paris"}
    assert json.loads(parsed.tool_calls[1].arguments) == {"tz": "CET"}
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id
    assert parsed.tool_calls[0].to_openai()["type"] == "function"


def test_hermes_without_calls_or_with_bad_json_is_plain_content() -> None:
    assert HermesToolParser().parse("just text").content == "just text"
    assert HermesToolParser().parse("just text").tool_calls == []
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesToolParser().parse(broken).content == broken
    assert HermesToolParser().parse(broken).tool_calls == []
    unterminated = '<tool_call>{"name": "f", "arguments": {}}'
    assert [c.name for c in HermesToolParser().parse(unterminated).tool_calls] == ["f"]
    assert HermesToolParser().parse('<tool_call>{"name": "f"}</tool_call>').content is None
    assert NoToolParser().parse("<tool_call>{}</tool_call>").tool_calls == []


def test_unknown_parser_and_held_back_marker_prefixes() -> None:
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_parser("nope")
    assert held_back("hello <tool", "<tool_call>") == 5
    assert held_back("hello <", "<tool_call>") == 1
    assert held_back("hello", "<tool_call>") == 0
    assert held_back("hello <", "") == 0


def test_splice_inserts_only_the_closing_the_model_did_not_produce() -> None:
    closing = [2, 10]  # "<|im_end|>", "\n"
    assert splice([5, 6, 2], closing, [1, 7]) == [5, 6, 2, 10, 1, 7]  # stopped on <|im_end|>
    assert splice([5, 6], closing, [1, 7]) == [5, 6, 2, 10, 1, 7]  # truncated: whole closing
    assert extends([1, 2], [1, 2, 3]) and not extends([1, 2], [1, 3, 3]) and not extends([1, 2], [1])


def _turn(prompt: list[int], response: list[int], *, version: str, new: bool, experts_start: int = 0) -> Turn:
    rows = len(prompt) + len(response) - 1 - experts_start
    return Turn(
        request_id="r",
        prompt_ids=prompt,
        response_ids=response,
        logprobs=[-0.5] * len(response),
        weight_versions=[WeightSpan(version, 0, len(response))],
        finish=Finish.STOP,
        status=Status.COMPLETED,
        text="x",
        routed_experts=RoutedExperts(np.full((rows, 1, 2), experts_start, dtype=np.uint8), experts_start),
        new_sample=new,
    )


def test_to_samples_masks_inserted_tokens_and_joins_spans_and_experts() -> None:
    session = Session("s")
    session.turns = [
        _turn([1, 2, 3], [4, 5], version="v1", new=True),
        _turn([1, 2, 3, 4, 5, 9, 9], [6], version="v2", new=False, experts_start=4),
    ]
    (sample,) = to_samples(session)
    assert list(sample.iter_token_ids()) == [1, 2, 3, 4, 5, 9, 9, 6]
    assert sample.response_length == 5
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert [(w.version, w.start, w.end) for w in sample.weight_versions] == [("v1", 0, 2), ("v2", 4, 5)]
    assert sample.routed_experts is not None and sample.routed_experts.start == 0
    assert sample.routed_experts.array.shape[0] == sample.token_count - 1
    assert list(sample.routed_experts.array[:, 0, 0]) == [0, 0, 0, 0, 4, 4, 4]


def test_to_samples_splits_where_a_turn_starts_a_new_sample() -> None:
    session = Session("s")
    session.turns = [
        _turn([1, 2, 3], [4, 5], version="v1", new=True),
        _turn([1, 2, 3, 8, 9], [6], version="v1", new=True),
    ]
    first, second = to_samples(session)
    assert list(first.iter_token_ids()) == [1, 2, 3, 4, 5] and first.loss_mask == [1, 1]
    assert list(second.iter_token_ids()) == [1, 2, 3, 8, 9, 6] and second.loss_mask == [1]


def test_append_observation_and_turn_budget() -> None:
    sample = make_sample([1, 2, 3])
    sample.tokens.extend([4, 5])
    sample.response_length = 2
    sample.loss_mask.extend([1, 1])
    sample.rollout_log_probs.extend([-0.1, -0.2])
    sample.status = pb.SAMPLE_STATUS_COMPLETED
    sample.finish_reason = pb.FINISH_REASON_STOP
    nxt = append_observation(sample, [7, 8, 9])
    assert list(nxt.tokens) == [1, 2, 3, 4, 5, 7, 8, 9]
    assert list(nxt.loss_mask) == [1, 1, 0, 0, 0]
    assert list(nxt.rollout_log_probs) == pytest.approx([-0.1, -0.2, 0.0, 0.0, 0.0])
    assert nxt.response_length == 5 and nxt.status == pb.SAMPLE_STATUS_PENDING
    assert sample.response_length == 2, "the input sample is not modified"
    assert turn_params(nxt, {"temperature": 1.0}, 16).max_new_tokens == 21
    assert turn_params(nxt, None, 16, total=10).max_new_tokens == 10
    with pytest.raises(ValueError):
        turn_params(nxt, None, 0)
    with pytest.raises(ValueError):
        append_observation(sample, [-1])


def test_openai_sampling_fields_map_to_domain_and_bad_types_name_the_field() -> None:
    params = sampling_params(
        {
            "temperature": 0,
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "stop": "END",
            "logit_bias": {"2": 100},
            "top_k": 3,
            "ignore_eos": True,
        }
    )
    assert params.temperature == 0.0 and params.max_new_tokens == 7 and params.top_k == 3
    assert params.stop == ["END"] and params.logit_bias == {2: 100.0} and params.ignore_eos is True
    assert params.skip_special_tokens is True, "OpenAI's default: no special tokens in content"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ]
    for body, field in cases:
        with pytest.raises(OpenAIError) as bad:
            sampling_params(body)
        assert bad.value.status == 400 and bad.value.param == field


def test_domain_errors_and_finish_reasons_in_openai_terms() -> None:
    err = from_domain(InvalidArgument("sampling_params.max_new_tokens", "too big"))
    assert (err.status, err.param) == (400, "max_tokens")
    busy = from_domain(ResourceExhausted("queue full", 2.4))
    assert busy.status == 429 and busy.headers["Retry-After"] == "2"
    assert from_domain(Unavailable("no engine")).status == 503
    assert finish_reason(Finish.STOP, tool_calls=True) == "tool_calls"
    assert finish_reason(Finish.ABORT, tool_calls=True) == "abort"
    assert finish_reason(Finish.LENGTH, tool_calls=False) == "length"
