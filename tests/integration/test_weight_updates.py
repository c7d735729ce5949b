"""UpdateWeights on a fleet of simulated engines: one serialised pause -> load -> label -> resume,
partial failures taken out of rotation, and every refusal before an engine is touched."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from rollout_grpc.client import make_sample, pb
from rollout_grpc.client.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    UnavailableError,
)
from rollout_grpc.sim import SimEngine
from tests.harness import Harness, harness
from tests.support.checkpoints import toy_checkpoint, truncate
from tests.support.service import PROMPT, assert_lossless, start_stream, started

SEEDED = {"temperature": 1.0, "seed": 7, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Harness]:
    async with harness("sim", sim_count=3, weights_path_prefixes=[str(tmp_path)]) as h:
        yield h


async def _seeded(h: Harness) -> tuple[list[float], list[str]]:
    sample = await h.client.generate(make_sample(PROMPT), SEEDED)
    return list(sample.rollout_log_probs), [w.version for w in sample.weight_versions]


async def _until(condition: Any) -> None:
    """Wait until `condition()` holds: state of the replica or the engines that no event announces
    (counters, log lines); bounded, never a fixed sleep."""
    async with asyncio.timeout(60):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def _untouched(sims: list[SimEngine]) -> bool:
    return all(s.stats.pause_calls == 0 and s.stats.weight_loads == 0 for s in sims)


async def test_an_update_reaches_every_engine_with_its_version(fleet: Harness, tmp_path: Path) -> None:
    before, versions = await _seeded(fleet)
    assert set(versions) == {"default"}
    response = await fleet.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1")
    assert response.weight_version == "v1"
    assert list(response.previous_versions) == ["default"]
    assert [e.updated for e in response.engines] == [True, True, True]
    assert response.paused_seconds >= response.load_seconds > 0
    for sim in fleet.sims:
        assert (sim.stats.weight_loads, sim.core.version, sim.core.paused) == (1, "v1", False)
    # The same seeded sample now comes from the new weights, on whichever engine, labelled v1.
    after = [await _seeded(fleet) for _ in range(3)]
    assert all(versions == ["v1"] for _, versions in after)
    assert all(logprobs == after[0][0] for logprobs, _ in after)
    assert after[0][0] != before
    info = await fleet.client.server_info()
    assert {e.weight_version for e in info.engines} == {"v1"}


async def test_refusals_touch_no_engine(fleet: Harness, tmp_path: Path) -> None:
    ckpt = str(toy_checkpoint(tmp_path / "v1", seed=1))
    with pytest.raises(PermissionDeniedError, match="--weights-path-prefix"):
        await fleet.client.update_weights("/etc", "v1")
    with pytest.raises(InvalidArgumentError, match=r"source\.checkpoint\.path"):
        await fleet.client.update_weights(str(tmp_path / ".." / "x"), "v1")
    for request, field in [
        (pb.UpdateWeightsRequest(weight_version="v1", pause_mode=pb.PAUSE_MODE_KEEP), "source"),
        (
            pb.UpdateWeightsRequest(checkpoint=pb.CheckpointSource(path=ckpt), weight_version="v1"),
            "pause_mode",
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await fleet.client._stub.UpdateWeights(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (info.value.details() or "")
    with pytest.raises(FailedPreconditionError, match="already serve"):
        await fleet.client.update_weights(ckpt, "default")
    corrupt = toy_checkpoint(tmp_path / "corrupt", seed=2)
    truncate(corrupt / "model.safetensors")
    with pytest.raises(FailedPreconditionError, match=r"model\.safetensors"):
        await fleet.client.update_weights(str(corrupt), "v1")
    with pytest.raises(FailedPreconditionError, match="not a directory"):
        await fleet.client.update_weights(str(tmp_path / "missing"), "v1")
    assert _untouched(fleet.sims)
    assert {s.core.version for s in fleet.sims} == {"default"}


async def test_an_unknown_source_kind_on_the_wire_is_refused(fleet: Harness) -> None:
    """A newer client's source (an unknown oneof member) arrives as an unknown field."""
    known = pb.UpdateWeightsRequest(weight_version="v1", pause_mode=pb.PAUSE_MODE_KEEP).SerializeToString()
    unknown = bytes([(15 << 3) | 2, 3]) + b"abc"  # field 15, length-delimited
    async with grpc.aio.insecure_channel(fleet.target) as channel:
        call = channel.unary_unary(
            "/rollout.v1.RolloutService/UpdateWeights",
            request_serializer=lambda b: b,
            response_deserializer=pb.UpdateWeightsResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(known + unknown)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "source" in (info.value.details() or "")
    assert _untouched(fleet.sims)


async def test_without_a_prefix_checkpoint_updates_are_off(tmp_path: Path) -> None:
    async with harness("sim", sim_count=1) as h:
        with pytest.raises(FailedPreconditionError, match="--weights-path-prefix"):
            await h.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1")
        assert _untouched(h.sims)


async def test_versions_only_move_forward(fleet: Harness, tmp_path: Path) -> None:
    await fleet.client.update_weights(str(toy_checkpoint(tmp_path / "a", seed=1)), "2")
    with pytest.raises(FailedPreconditionError, match="backwards"):
        await fleet.client.update_weights(str(toy_checkpoint(tmp_path / "b", seed=2)), "1")
    with pytest.raises(FailedPreconditionError, match="already serve"):
        await fleet.client.update_weights(str(tmp_path / "b"), "2")
    await fleet.client.update_weights(str(tmp_path / "b"), "3")
    assert {s.core.version for s in fleet.sims} == {"3"}


async def test_an_engine_that_fails_to_load_leaves_the_rotation_until_a_retry(
    fleet: Harness, tmp_path: Path
) -> None:
    bad = fleet.sims[1]
    bad.faults.load_fault = "error"
    ckpt = str(toy_checkpoint(tmp_path / "v1", seed=1))
    with pytest.raises(UnavailableError) as info:
        await fleet.client.update_weights(ckpt, "v1", all_at_once=True)
    message = info.value.details() or ""
    assert bad.url in message and "simulated worker failure" in message and "Repeat the same call" in message
    assert [s.core.version for s in fleet.sims] == ["v1", "default", "v1"]
    assert all(not s.core.paused for s in fleet.sims)
    handle = fleet.server.pool.get(bad.url)
    assert handle is not None and not handle.usable and "simulated worker failure" in handle.weights_problem
    # Nothing new reaches it: every sample is v1.
    for _ in range(4):
        _, versions = await _seeded(fleet)
        assert versions == ["v1"]
    # The engine is repaired (restarted); the same call loads on it alone and takes it back.
    bad.faults.clear()
    loads = [s.stats.weight_loads for s in fleet.sims]
    response = await fleet.client.update_weights(ckpt, "v1", all_at_once=True)
    assert response.retry and [e.engine for e in response.engines] == [bad.url]
    assert [s.stats.weight_loads - n for s, n in zip(fleet.sims, loads, strict=True)] == [0, 1, 0]
    assert handle.usable and {s.core.version for s in fleet.sims} == {"v1"}


async def test_a_staged_update_stops_at_the_first_failed_engine(fleet: Harness, tmp_path: Path) -> None:
    first = fleet.sims[0]
    first.faults.load_fault = "error"
    with pytest.raises(UnavailableError, match="no engine serves it") as info:
        await fleet.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1")
    assert first.url in (info.value.details() or "")
    assert [s.stats.weight_loads for s in fleet.sims] == [1, 0, 0]
    assert {s.core.version for s in fleet.sims} == {"default"}
    usable = [e.url for e in fleet.server.pool.engines if e.usable]
    assert usable == [s.url for s in fleet.sims[1:]]  # the others serve v0 as before
    _, versions = await _seeded(fleet)
    assert versions == ["default"]


async def test_an_engine_that_dies_mid_update_is_reported(fleet: Harness, tmp_path: Path) -> None:
    dying = fleet.sims[2]
    dying.faults.load_fault = "drop"
    with pytest.raises(UnavailableError) as info:
        await fleet.client.update_weights(
            str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1", all_at_once=True
        )
    assert dying.url in (info.value.details() or "")
    assert [s.core.version for s in fleet.sims[:2]] == ["v1", "v1"]
    handle = fleet.server.pool.get(dying.url)
    assert handle is not None and not handle.usable


async def test_a_second_update_while_one_runs_is_refused(fleet: Harness, tmp_path: Path) -> None:
    for sim in fleet.sims:
        sim.faults.load_fault = "hang"
    first = asyncio.create_task(
        fleet.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1", all_at_once=True)
    )
    await _until(lambda: all(s.stats.weight_loads == 1 for s in fleet.sims))
    with pytest.raises(FailedPreconditionError, match="in progress"):
        await fleet.client.update_weights(str(toy_checkpoint(tmp_path / "v2", seed=2)), "v2")
    assert all(s.stats.weight_loads == 1 for s in fleet.sims)
    for sim in fleet.sims:
        sim.faults.load_fault = ""
    assert (await first).weight_version == "v1"
    assert {s.core.version for s in fleet.sims} == {"v1"}


async def test_a_caller_that_leaves_mid_update_leaves_a_resumed_consistent_fleet(
    fleet: Harness, tmp_path: Path
) -> None:
    for sim in fleet.sims:
        sim.faults.load_fault = "hang"
    with capture_logs() as logs:
        call = asyncio.create_task(
            fleet.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1", all_at_once=True)
        )
        await _until(lambda: all(s.stats.weight_loads == 1 for s in fleet.sims))
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await _until(lambda: any(e["event"] == "weight_update_caller_gone" for e in logs))
        assert all(s.core.paused for s in fleet.sims)  # still loading
        for sim in fleet.sims:
            sim.faults.load_fault = ""
        await _until(lambda: fleet.server.weights.running is None)
    assert all(not s.core.paused and s.core.version == "v1" for s in fleet.sims)
    done = [e for e in logs if e["event"] == "weight_update_done"]
    assert len(done) == 1 and done[0]["weight_version"] == "v1" and len(done[0]["updated"]) == 3
    _, versions = await _seeded(fleet)
    assert versions == ["v1"]


async def test_pause_keep_carries_a_generation_across_the_update(tmp_path: Path) -> None:
    async with harness(
        "sim", sim_count=2, sim_config={"token_delay_s": 0.005}, weights_path_prefixes=[str(tmp_path)]
    ) as h:
        stream = start_stream(
            h.client, "across", {"temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True}
        )
        await started(stream)
        await h.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1", pause_mode="keep")
        final = await stream.task
        assert final.status == pb.SAMPLE_STATUS_TRUNCATED and final.response_length == 400
        assert_lossless(stream, final)
        spans = [(w.version, w.start, w.end) for w in final.weight_versions]
        assert [v for v, _, _ in spans] == ["default", "v1"]
        assert spans[0][1] == 0 and spans[0][2] == spans[1][1] and spans[1][2] == 400


async def test_sglang_engines_load_from_disk(tmp_path: Path) -> None:
    async with harness("sim-sglang", sim_count=2, weights_path_prefixes=[str(tmp_path)]) as h:
        await h.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1")
        assert [(s.stats.weight_loads, s.core.version) for s in h.sims] == [(1, "v1"), (1, "v1")]
        h.sims[0].faults.load_fault = "error"
        with pytest.raises(UnavailableError, match="Rolling back to original weights"):
            await h.client.update_weights(str(toy_checkpoint(tmp_path / "v2", seed=2)), "v2")
        assert [s.core.version for s in h.sims] == ["v1", "v1"]  # staged: the second engine untouched


async def test_an_update_is_audited_with_its_target_and_outcome(fleet: Harness, tmp_path: Path) -> None:
    ckpt = str(toy_checkpoint(tmp_path / "v1", seed=1))
    with capture_logs() as logs:
        await fleet.client.update_weights(ckpt, "v1")
        with pytest.raises(PermissionDeniedError):
            await fleet.client.update_weights("/etc", "v2")
    audits = [e for e in logs if e["event"] == "audit" and e["method"].endswith("/UpdateWeights")]
    assert [(a["outcome"], a["weight_version"], a["path"]) for a in audits] == [
        ("OK", "v1", ckpt),
        ("PERMISSION_DENIED", "v2", "/etc"),
    ]
    assert audits[0]["updated_engines"] == 3 and audits[0]["source"] == "checkpoint"


async def test_colocated_release_load_and_resume(fleet: Harness, tmp_path: Path) -> None:
    """The colocated loop: free the memory, take the weights back, load new ones, take the KV cache
    back; the engines generate again only at the end, on the new weights and label."""
    released = await fleet.client.release_memory(level=2)
    assert sorted(released.released_engines) == sorted(s.url for s in fleet.sims)
    assert all(s.core.sleeping and s.core.paused for s in fleet.sims)
    weights_back = await fleet.client.resume_memory(["weights"])
    assert not weights_back.generating and all(s.core.sleeping for s in fleet.sims)
    await fleet.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1")
    assert all(s.core.paused and s.core.version == "v1" for s in fleet.sims)  # resume deferred
    everything = await fleet.client.resume_memory(["kv_cache"])
    assert everything.generating
    assert all(not s.core.sleeping and not s.core.paused for s in fleet.sims)
    _, versions = await _seeded(fleet)
    assert versions == ["v1"]


async def test_memory_calls_refuse_bad_input_and_updates_in_progress(fleet: Harness, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="tags"):
        await fleet.client.release_memory(tags=["gpu"])
    with pytest.raises(InvalidArgumentError, match="level"):
        await fleet.client.release_memory(level=3)
    assert all(s.stats.pause_calls == 0 for s in fleet.sims)
    for sim in fleet.sims:
        sim.faults.load_fault = "hang"
    update = asyncio.create_task(
        fleet.client.update_weights(str(toy_checkpoint(tmp_path / "v1", seed=1)), "v1", all_at_once=True)
    )
    await _until(lambda: all(s.stats.weight_loads == 1 for s in fleet.sims))
    with pytest.raises(FailedPreconditionError, match="weight update"):
        await fleet.client.release_memory()
    for sim in fleet.sims:
        sim.faults.load_fault = ""
    await update


async def test_sglang_engines_release_and_resume_memory(tmp_path: Path) -> None:
    async with harness("sim-sglang", sim_count=2, weights_path_prefixes=[str(tmp_path)]) as h:
        await h.client.release_memory(tags=["kv_cache"])
        assert all(s.core.asleep_tags == {"kv_cache"} for s in h.sims)
        resumed = await h.client.resume_memory()
        assert resumed.generating and all(not s.core.sleeping for s in h.sims)
        sample = await h.client.generate(make_sample(PROMPT), SEEDED)
        assert sample.response_length == 8


async def test_the_slime_hook_updates_weights_through_the_service(tmp_path: Path) -> None:
    from rollout_grpc.integrations import slime
    from tests.client.slime_scenarios import slime_args
    from tests.client.slime_types import Sample

    async with harness("sim", sim_count=2, weights_path_prefixes=[str(tmp_path)]) as h:
        args = slime_args(h.target)
        await slime.update_weights(args, str(toy_checkpoint(tmp_path / "step-12", seed=12)), "12")
        assert {s.core.version for s in h.sims} == {"12"}
        sample = await slime.generate(args, Sample(index=0, tokens=list(PROMPT)), {"max_new_tokens": 4})
        assert sample.weight_versions == ["12"]
