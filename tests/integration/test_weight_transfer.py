"""UpdateWeights from a trainer's broadcast (distributed source) on simulated engines: the rank plan,
the group joined once, the lifecycle on every engine, and the refusals. The simulators follow the
engines' routes and bodies; the NCCL broadcast itself (GPU) is not exercised here."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rollout_grpc.client import make_sample, pb
from rollout_grpc.client.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from tests.harness import Harness, harness
from tests.support.service import PROMPT

SEEDED = {"temperature": 1.0, "seed": 7, "max_new_tokens": 8, "ignore_eos": True}
Tensors = list[tuple[str, str, list[int]]]
TENSORS: Tensors = [
    ("model.embed_tokens.weight", "bfloat16", [2048, 64]),
    ("model.norm.weight", "bfloat16", [64]),
]


async def _update(
    h: Harness,
    version: str,
    *,
    world_size: int,
    tensors: Tensors = TENSORS,
    master_port: int = 29500,
    group_name: str = "weight_update_group",
) -> pb.UpdateWeightsResponse:
    return await h.client.update_weights_distributed(
        version,
        master_address="10.0.0.5",
        master_port=master_port,
        world_size=world_size,
        tensors=tensors,
        group_name=group_name,
    )


@pytest.fixture
async def fleet() -> AsyncIterator[Harness]:
    async with harness("sim", sim_count=3, sim_config={"weight_transfer": "nccl"}) as h:
        yield h


async def _seeded(h: Harness) -> tuple[list[float], list[str]]:
    sample = await h.client.generate(make_sample(PROMPT), SEEDED)
    return list(sample.rollout_log_probs), [w.version for w in sample.weight_versions]


async def test_the_plan_gives_the_trainer_rank_zero_and_each_engine_a_block(fleet: Harness) -> None:
    plan = await fleet.client.plan_weight_transfer()
    assert plan.world_size == 4
    assert [(e.engine, e.rank_offset, e.ranks) for e in plan.engines] == [
        (sim.url, 1 + i, 1) for i, sim in enumerate(fleet.sims)
    ]
    wider = await fleet.client.plan_weight_transfer(trainer_ranks=2)
    assert wider.world_size == 5 and [e.rank_offset for e in wider.engines] == [2, 3, 4]


async def test_a_distributed_update_joins_once_and_receives_on_every_engine(fleet: Harness) -> None:
    before, _ = await _seeded(fleet)
    plan = await fleet.client.plan_weight_transfer()
    response = await _update(fleet, "v1", world_size=plan.world_size)
    assert [e.updated for e in response.engines] == [True, True, True]
    for i, sim in enumerate(fleet.sims):
        joined = sim.core.transfer_groups[""]
        assert (joined["rank_offset"], joined["world_size"], joined["master_port"]) == (1 + i, 4, 29500)
        assert (sim.stats.weight_loads, sim.core.version, sim.core.transfer_active) == (1, "v1", False)
        joined["marker"] = True  # a second update must not join again
    after = [await _seeded(fleet) for _ in range(3)]
    assert all(versions == ["v1"] for _, versions in after) and after[0][0] != before
    assert all(logprobs == after[0][0] for logprobs, _ in after)  # one broadcast, one model
    await _update(fleet, "v2", world_size=plan.world_size)
    assert all(s.core.transfer_groups[""].get("marker") and s.stats.weight_loads == 2 for s in fleet.sims)
    assert {s.core.version for s in fleet.sims} == {"v2"}


async def test_distributed_refusals_name_the_field_and_touch_no_engine(fleet: Harness) -> None:
    with pytest.raises(FailedPreconditionError, match="PlanWeightTransfer"):
        await _update(fleet, "v1", world_size=4)
    await fleet.client.plan_weight_transfer()
    with pytest.raises(FailedPreconditionError, match="world_size 5"):
        await _update(fleet, "v1", world_size=5)
    with pytest.raises(InvalidArgumentError, match=r"tensors\[1\]\.dtype"):
        await _update(fleet, "v1", world_size=4, tensors=[TENSORS[0], ("x", "bf16", [1])])
    with pytest.raises(InvalidArgumentError, match=r"distributed\.tensors"):
        await _update(fleet, "v1", world_size=4, tensors=[])
    with pytest.raises(InvalidArgumentError, match="master_port"):
        await _update(fleet, "v1", world_size=4, master_port=0)
    assert all(s.stats.pause_calls == 0 and not s.core.transfer_groups for s in fleet.sims)
    fleet.server.pool.drain(fleet.sims[2].url)  # the fleet changes after the plan
    with pytest.raises(FailedPreconditionError, match="plan again"):
        await _update(fleet, "v1", world_size=4)


async def test_an_engine_failing_to_receive_leaves_the_rotation(fleet: Harness) -> None:
    plan = await fleet.client.plan_weight_transfer()
    fleet.sims[1].faults.load_fault = "error"
    with pytest.raises(UnavailableError) as info:
        await _update(fleet, "v1", world_size=plan.world_size)
    message = info.value.details() or ""
    assert fleet.sims[1].url in message and "simulated worker failure while receiving" in message
    assert [s.core.version for s in fleet.sims] == ["v1", "default", "v1"]
    assert [e.usable for e in fleet.server.pool.engines] == [True, False, True]


async def test_engines_without_a_transfer_backend_keep_serving() -> None:
    """vLLM started without --weight-transfer-config: joining fails, nothing was received, the
    fleet stays on its weights and in rotation; the call names the route and vLLM's cause."""
    async with harness("sim", sim_count=2) as h:
        plan = await h.client.plan_weight_transfer()
        with pytest.raises(UnavailableError, match="Weight transfer not configured") as info:
            await _update(h, "v1", world_size=plan.world_size)
        assert "/init_weight_transfer_engine" in (info.value.details() or "")
        assert all(e.usable for e in h.server.pool.engines)
        assert {s.core.version for s in h.sims} == {"default"}


async def test_sglang_engines_join_the_named_group_and_receive() -> None:
    async with harness("sim-sglang", sim_count=2) as h:
        plan = await h.client.plan_weight_transfer()
        assert plan.world_size == 3
        await _update(h, "v1", world_size=3, group_name="actor-sync")
        for i, sim in enumerate(h.sims):
            assert sim.core.transfer_groups["actor-sync"]["rank_offset"] == 1 + i
            assert (sim.stats.weight_loads, sim.core.version) == (1, "v1")


async def test_the_simulator_closes_the_connection_after_a_worker_failure_as_vllm_does() -> None:
    """vLLM answers a worker failure in a route without error handling with the 500 envelope and
    then closes the connection (measured); the simulator does the same."""
    import aiohttp

    async with harness("sim", sim_count=1) as h, aiohttp.ClientSession() as http:
        body = {
            "init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
        }
        async with http.post(f"{h.sims[0].url}/init_weight_transfer_engine", json=body) as resp:
            assert resp.status == 500
            assert resp.headers.get("Connection", "").lower() == "close"
            assert "Weight transfer not configured" in (await resp.json())["error"]["message"]
