"""slime-shaped scenarios through rollout_grpc.integrations.slime, run against any live replica.

Shared by tests/client/test_slime.py (a replica on simulated engines; also run by the client matrix)
and tests/integration/test_slime_hook.py (parametrised over `backend`: simulator and real vLLM).
"""

from __future__ import annotations

import asyncio
import copy
import time
import types
import uuid
from typing import Any

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


async def keeps_everything_slime_owns(target: str) -> None:
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


async def over_sampled_rollout_with_abort_and_continuation(target: str) -> None:
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


async def weight_update_between_calls_records_one_version_per_call(target: str) -> None:
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


SCENARIOS = [
    keeps_everything_slime_owns,
    over_sampled_rollout_with_abort_and_continuation,
    weight_update_between_calls_records_one_version_per_call,
]
