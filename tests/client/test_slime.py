"""rollout_grpc.integrations.slime driven like slime drives its generate hook, on a live replica.

The samples are `tests/client/slime_types.Sample` objects: slime's field names and types.
"""

from __future__ import annotations

import asyncio
import copy
import time
import types
import uuid
from typing import Any

import numpy as np
import pytest

from rollout_grpc.client import pb, routed_experts_message
from rollout_grpc.integrations import slime
from tests.client.slime_types import Sample

PROMPT = [1, 92, 510, 206, 33]
#: What slime's GenerateState builds (SGLang names), with a short budget.
SLIME_PARAMS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 16,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}


def slime_args(target: str, **extra: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(rollout_grpc_target=target, use_rollout_routing_replay=False, **extra)


def new_sample(index: int, group: int = 0, **fields: Any) -> Sample:
    return Sample(index=index, group_index=group, tokens=list(PROMPT), **fields)


def assert_trainable(sample: Sample) -> None:
    """slime's trainer contract: mask, length and logprobs agree; tokens hold prompt + response."""
    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs)
    assert len(sample.tokens) == len(PROMPT) + sample.response_length
    assert sample.tokens[: len(PROMPT)] == PROMPT


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


async def test_generate_keeps_everything_slime_owns(target: str) -> None:
    """Fields the service never needs come back identical, ints as ints, objects as the same objects."""
    metadata = {"n": 3, "nested": {"ids": [1, 2], "ratio": 0.5}, "rm_type": "math", "start_rollout_id": 12}
    reward = {"acc": 1, "format": 0.5}
    sample = new_sample(
        7,
        group=2,
        label="42",
        reward=reward,
        metadata=copy.deepcopy(metadata),
        train_metadata={"loss": "grpo", "k": 1},
        session_id="s-1",
    )
    setattr(sample, "custom_field", {"step": 5})  # noqa: B010  (slime keeps unknown attributes)
    done = await slime.generate(slime_args(target), sample, dict(SLIME_PARAMS))
    assert done is sample
    assert sample.status is Sample.Status.COMPLETED or sample.status is Sample.Status.TRUNCATED
    assert_trainable(sample)
    assert sample.metadata == metadata and type(sample.metadata["n"]) is int
    assert type(sample.metadata["nested"]["ids"][0]) is int
    assert (
        sample.reward == reward and sample.label == "42" and sample.train_metadata == {"loss": "grpo", "k": 1}
    )
    assert sample.index == 7 and sample.group_index == 2 and sample.session_id == "s-1"
    assert getattr(sample, "custom_field") == {"step": 5}  # noqa: B009
    assert len(sample.weight_versions) == 1 and isinstance(sample.weight_versions[0], str)
    assert sample.prefix_cache_info.total_prompt_tokens == len(PROMPT)
    again = Sample.from_dict(sample.to_dict())  # slime's own serialisation still round-trips
    assert again == sample and getattr(again, "custom_field") == {"step": 5}  # noqa: B009


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


async def test_over_sampled_rollout_with_abort_and_continuation(target: str) -> None:
    """slime's loop: submit more groups than needed, keep the first finished, abort the rest, and
    continue the aborted samples next rollout (partial rollout) without losing a token."""
    args = slime_args(target)
    n_per_prompt, target_groups = 2, 2
    short = {**SLIME_PARAMS, "max_new_tokens": 8, "ignore_eos": True}
    long = {**SLIME_PARAMS, "max_new_tokens": 400, "ignore_eos": True}
    groups = [[new_sample(g * n_per_prompt + i, group=g) for i in range(n_per_prompt)] for g in range(4)]
    budgets = [short, short, long, long]
    pending = {
        asyncio.ensure_future(slime.generate_group(args, group, params)): g
        for g, (group, params) in enumerate(zip(groups, budgets, strict=True))
    }
    finished: list[int] = []
    while len(finished) < target_groups:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED, timeout=30)
        assert done, "no group finished within 30 s"
        for task in done:
            finished.append(pending.pop(task))
    assert sorted(finished) == [0, 1]
    assert await slime.abort_all(args) >= 1  # the long groups were still in flight
    leftovers = await asyncio.wait_for(asyncio.gather(*pending), 30)
    aborted = [s for group in leftovers for s in group]
    assert all(s.status is Sample.Status.ABORTED for s in aborted)
    for s in aborted:
        assert_trainable(s)
        s.metadata["start_rollout_id"] = 3  # what slime stamps on recycled groups

    # Next rollout: the aborted samples come back from slime's buffer as they are.
    before = {s.index: (list(s.tokens), list(s.rollout_log_probs or []), s.response) for s in aborted}
    resumed = await asyncio.wait_for(
        asyncio.gather(*(slime.generate(args, s, dict(long)) for s in aborted)), 30
    )
    for s in resumed:
        tokens, logprobs, response = before[s.index]
        assert s.status is Sample.Status.TRUNCATED and s.response_length == 400
        assert s.tokens[: len(tokens)] == tokens and (s.rollout_log_probs or [])[: len(logprobs)] == logprobs
        assert s.response.startswith(response)
        assert s.metadata == {"start_rollout_id": 3}
        assert_trainable(s)
        assert len(s.weight_versions) == (2 if len(tokens) > len(PROMPT) else 1)


async def test_weight_update_between_calls_records_one_version_per_call(target: str) -> None:
    """abort -> pause -> (weights update) -> resume(version) -> continue: the continuation's entry
    is the new version, the first call's the old one."""
    args = slime_args(target)
    new_version = f"v-{uuid.uuid4().hex[:8]}"
    sample = new_sample(0)
    long = {**SLIME_PARAMS, "max_new_tokens": 300, "ignore_eos": True}
    task = asyncio.ensure_future(slime.generate(args, sample, dict(long)))
    client = slime.client_for(args)
    deadline = time.monotonic() + 10
    while (await client.server_info()).in_flight < 1:  # until the long call is on an engine
        assert time.monotonic() < deadline, "the generate call never got in flight"
        await asyncio.sleep(0.005)
    await slime.pause(args, "abort")  # ends the call in flight as ABORTED
    try:
        first = await asyncio.wait_for(task, 30)
    finally:
        await slime.resume(args, new_version)
    assert first.status is Sample.Status.ABORTED and first.response_length < 300
    old_version = first.weight_versions[0] if first.weight_versions else None
    assert old_version != new_version
    continued = await slime.generate(args, first, dict(long))
    assert continued is first
    assert continued.status is Sample.Status.TRUNCATED and continued.response_length == 300
    assert continued.weight_versions[-1] == new_version
    assert continued.weight_versions[:-1] == ([old_version] if old_version else [])
    assert_trainable(continued)


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
