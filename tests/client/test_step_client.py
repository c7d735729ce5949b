"""The clients' rollout_step on every supported interpreter and protobuf (the client matrix runs it):
request building from tuples and JSON dicts, the async iterator and the blocking generator."""

from __future__ import annotations

import asyncio

import pytest

from rollout_grpc.client import AsyncRolloutClient, RolloutClient, make_sample, pb
from rollout_grpc.client.step import step_request
from tests.client.common import PROMPT, SHORT


def test_a_request_from_tuples_and_json_dicts() -> None:
    request = step_request(
        [(PROMPT, 3), (make_sample(PROMPT), 4, "42")],
        n_samples_per_prompt=2,
        step_id="s",
        reward={"kind": "REWARD_KIND_MATH", "scope": "REWARD_SCOPE_GROUP"},
        filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD", "epsilon": 0.1},
        leftovers="buffer",
        max_staleness=0,
    )
    assert [g.group_index for g in request.groups] == [3, 4] and request.groups[1].label == "42"
    assert list(request.groups[0].prompt.tokens) == PROMPT
    assert request.reward.kind == pb.REWARD_KIND_MATH and request.reward.scope == pb.REWARD_SCOPE_GROUP
    assert request.filter.epsilon == pytest.approx(0.1)
    assert request.leftovers == pb.LEFTOVER_POLICY_BUFFER
    assert request.HasField("max_staleness") and request.max_staleness == 0
    with pytest.raises(ValueError, match="leftovers"):
        step_request([(PROMPT, 0)], n_samples_per_prompt=1, leftovers="keep")


async def test_the_async_and_blocking_clients_run_a_step(target: str) -> None:
    async with AsyncRolloutClient(target) as client:
        events = [
            e
            async for e in client.rollout_step(
                [(PROMPT, 0), (PROMPT, 1)], n_samples_per_prompt=2, params=SHORT
            )
        ]
    assert events[-1].WhichOneof("event") == "summary" and events[-1].summary.accepted == 2

    def blocking() -> list[pb.RolloutStepResponse]:
        with RolloutClient(target) as client:
            return list(client.rollout_step([(PROMPT, 0)], n_samples_per_prompt=3, params=SHORT))

    groups = [e.group for e in await asyncio.to_thread(blocking) if e.WhichOneof("event") == "group"]
    assert len(groups) == 1 and len(groups[0].samples) == 3
    assert all(s.response_length == SHORT["max_new_tokens"] for s in groups[0].samples)
