"""rollout_grpc.integrations.slime driven like slime drives its generate hook, on a live replica.

The samples are `tests/client/slime_types.Sample` objects: slime's field names and types.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from rollout_grpc.client import pb, routed_experts_message
from rollout_grpc.integrations import slime
from tests.client.slime_scenarios import (
    SCENARIOS,
    SLIME_PARAMS,
    new_sample,
    slime_args,
)
from tests.client.slime_types import Sample

# ---- sampling params -----------------------------------------------------------------------------


def test_slime_params_are_translated() -> None:
    params = slime.translate_sampling_params(
        {**SLIME_PARAMS, "sampling_seed": 43, "stop": ["</s>"], "stop_token_ids": [2], "min_new_tokens": 3}
    )
    assert params.seed == 43 and list(params.stop) == ["</s>"] and list(params.stop_token_ids) == [2]
    assert params.max_new_tokens == 16 and params.top_k == -1 and params.no_stop_trim is True
    assert params.min_new_tokens == 3 and not params.HasField("ignore_eos")  # None/absent = default
    seeded = slime.translate_sampling_params({"sampling_seed": np.int64(7), "max_new_tokens": np.int32(4)})
    assert seeded.seed == 7 and seeded.max_new_tokens == 4


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"max_new_token": 8}, "'max_new_token'"),
        ({"custom_params": {"return_top_p_token_ids": True}}, "'custom_params.return_top_p_token_ids'"),
        ({"return_top_p_token_ids": True}, "'return_top_p_token_ids'"),
        ({"n": 4}, "'n'"),
        ({"max_new_tokens": 8.5}, "'max_new_tokens'"),
        ({"temperature": "hot"}, "'temperature'"),
        ({"sampling_seed": 1, "seed": 2}, "'sampling_seed' and 'seed'"),
    ],
)
def test_unsupported_params_name_the_slime_key(params: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match="slime sampling param") as err:
        slime.translate_sampling_params(params)
    assert named in str(err.value) and "maxNewTokens" not in str(err.value)


def test_custom_params_without_top_p_ids_is_fine() -> None:
    assert (
        slime.translate_sampling_params({"custom_params": {"return_top_p_token_ids": False}}).ByteSize() == 0
    )


# ---- target --------------------------------------------------------------------------------------


def test_target_from_args_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(slime.TARGET_ENV, raising=False)
    with pytest.raises(ValueError, match=r"args.rollout_grpc_target or the ROLLOUT_GRPC_TARGET"):
        slime.target_of(types.SimpleNamespace())
    monkeypatch.setenv(slime.TARGET_ENV, "env-host:1")
    assert slime.target_of(types.SimpleNamespace()) == "env-host:1"
    assert slime.target_of(types.SimpleNamespace(rollout_grpc_target="arg-host:2")) == "arg-host:2"


# ---- one call ------------------------------------------------------------------------------------


async def test_params_dict_is_not_modified_and_prompt_text_works(target: str) -> None:
    params = dict(SLIME_PARAMS)
    sample = Sample(index=0, prompt="Hello there", tokens=[])
    await slime.generate(slime_args(target), sample, params)
    assert params == SLIME_PARAMS
    assert sample.tokens and sample.response_length > 0
    assert len(sample.rollout_log_probs or []) == sample.response_length


async def test_finished_samples_are_refused(target: str) -> None:
    sample = new_sample(0, status=Sample.Status.COMPLETED)
    with pytest.raises(ValueError, match="PENDING or ABORTED"):
        await slime.generate(slime_args(target), sample, dict(SLIME_PARAMS))


def test_one_client_per_target_used_from_several_event_loops(target: str) -> None:
    """slime runs its rollout in a loop of its own; each loop gets its own channel."""
    args = slime_args(target)
    results = [
        asyncio.run(slime.generate(args, new_sample(i), {**SLIME_PARAMS, "temperature": 0.0}))
        for i in range(2)
    ]
    assert results[0].tokens == results[1].tokens  # greedy, two loops, one client
    assert slime.client_for(args) is slime.client_for(slime_args(target))


# ---- a slime-shaped rollout: groups, over-sampling, abort, continuation, versions ----------------


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
async def test_slime_scenario(target: str, scenario: Callable[[str], Awaitable[None]]) -> None:
    await scenario(target)


# ---- routed experts and multimodal conversion (no MoE/VL engine needed) --------------------------


def test_routed_experts_become_int32_rows_per_token_but_the_last() -> None:
    sample = new_sample(0)
    sent = slime.to_wire(sample)
    result = pb.Sample()
    result.CopyFrom(sent)
    result.tokens.extend([7, 8, 9])
    result.response_length = 3
    result.loss_mask.extend([1, 1, 1])
    result.rollout_log_probs.extend([-0.1, -0.2, -0.3])
    result.status = pb.SAMPLE_STATUS_COMPLETED
    result.weight_versions.add(version="v1", start=0, end=3)
    routing = np.arange(7 * 2 * 4, dtype=np.uint8).reshape(7, 2, 4)
    result.routed_experts.CopyFrom(routed_experts_message(routing))
    slime.apply_result(sample, result, sent)
    experts = sample.rollout_routed_experts
    assert experts.dtype == np.int32 and experts.shape == (len(sample.tokens) - 1, 2, 4)
    assert np.array_equal(experts, routing.astype(np.int32))
    assert sample.weight_versions == ["v1"] and sample.status is Sample.Status.COMPLETED

    # A later call whose engine reports rows from position 5 on keeps the earlier rows.
    sent = slime.to_wire(sample)
    result.tokens.append(10)
    result.response_length = 4
    result.loss_mask.append(1)
    result.rollout_log_probs.append(-0.4)
    result.weight_versions[0].end = 4
    tail = np.full((3, 2, 4), 9, dtype=np.uint16)
    result.routed_experts.CopyFrom(routed_experts_message(tail, start=5))
    slime.apply_result(sample, result, sent)
    assert sample.rollout_routed_experts.shape == (8, 2, 4)
    assert np.array_equal(sample.rollout_routed_experts[:5], routing[:5].astype(np.int32))
    assert (sample.rollout_routed_experts[5:] == 9).all()
    assert sample.weight_versions == ["v1", "v1"]  # one entry per engine call


def test_image_prompts_become_chat_messages_for_render() -> None:
    png = b"\x89PNG fake"
    text_prompt = Sample(prompt="Look <image> and <image>!", multimodal_inputs={"images": [png, png]})
    assert slime.chat_for_render(text_prompt) == [
        {"role": "user", "content": ["Look ", png, " and ", png, "!"]}
    ]
    chat_prompt = Sample(
        prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}],
        multimodal_inputs={"images": [png]},
    )
    assert slime.chat_for_render(chat_prompt) == [{"role": "user", "content": [png, "what?"]}]
    with pytest.raises(ValueError, match="more images"):
        slime.chat_for_render(Sample(prompt="no placeholder", multimodal_inputs={"images": [png]}))
