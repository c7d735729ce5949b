"""The engine capability check: misconfigured engines are named, explained and not routed to."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc.client import make_sample
from rollout_grpc.server.app import SERVICE_NAME
from rollout_grpc.server.engines.api import EngineCapabilities
from rollout_grpc.server.engines.vllm.info import ServerInfo, classify, parse_server_info
from tests.harness import harness, running_server, sim_engines


async def _health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10
        )
        return int(reply.status)


async def test_engine_without_scale_out_is_not_routed_and_says_which_flag() -> None:
    async with harness("sim", sim_config={"scale_out": False}) as h:
        info = await h.client.server_info()
        engine = info.engines[0]
        assert not engine.usable
        assert any("--enable-scale-out" in p for p in engine.problems)
        assert engine.capabilities.scale_out is False
        assert await _health(h.server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.client.generate(make_sample([1, 2, 3]), {"max_new_tokens": 4})
        # A deployment problem, never the caller's INVALID_ARGUMENT.
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_engine_without_dev_mode_is_not_routed_and_says_which_variable() -> None:
    async with harness("sim", sim_config={"dev_mode": False}) as h:
        engine = (await h.client.server_info()).engines[0]
        assert not engine.usable
        assert engine.capabilities.dev_mode is False
        assert any("VLLM_SERVER_DEV_MODE=1" in p for p in engine.problems)
        assert await _health(h.server.port) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_one_bad_engine_leaves_the_good_one_serving() -> None:
    async with sim_engines(1) as good, sim_engines(1, scale_out=False) as bad:
        urls = [good[0].url, bad[0].url]
        async with running_server(urls) as server:
            assert await _health(server.port) == health_pb2.HealthCheckResponse.SERVING
            usable = {e.url for e in server.pool.engines if e.usable}
            assert usable == {good[0].url}


@pytest.mark.parametrize(("policy", "usable"), [("refuse", False), ("warn", True)])
async def test_raw_logprobs_policy(policy: str, usable: bool) -> None:
    async with harness("sim", raw_logprobs=policy) as h:
        engine = (await h.client.server_info()).engines[0]
        assert engine.capabilities.logprobs_mode == "raw_logprobs"
        assert engine.usable is usable
        texts = list(engine.problems) + list(engine.warnings)
        assert any("--logprobs-mode processed_logprobs" in t for t in texts)
        assert bool(engine.problems) is not usable


async def test_processed_logprobs_engine_is_clean_and_fully_described() -> None:
    config = {"logprobs_mode": "processed_logprobs", "max_model_len": 2048}
    async with harness("sim", sim_config=config, raw_logprobs="refuse") as h:
        info = await h.client.server_info()
        engine = info.engines[0]
        assert engine.usable and not engine.problems and not engine.warnings
        caps = engine.capabilities
        assert (caps.scale_out, caps.dev_mode, caps.moe) == (True, True, False)
        assert (caps.max_model_len, caps.model) == (2048, "sim-llama")
        assert not info.simulated_engines  # engines given by URL are not flagged as simulated


async def test_moe_engine_without_routed_experts_is_flagged() -> None:
    async with harness("sim", sim_config={"moe_experts": 8}) as h:
        engine = (await h.client.server_info()).engines[0]
        assert engine.capabilities.moe is True and engine.capabilities.routed_experts is False
        assert engine.usable
        assert any("--enable-return-routed-experts" in w for w in engine.warnings)


async def test_an_engine_that_joins_is_checked_before_it_is_routed_to() -> None:
    async with (
        sim_engines(1) as good,
        sim_engines(1, dev_mode=False) as bad,
        running_server([good[0].url]) as server,
    ):
        server.pool.replace([good[0].url, bad[0].url])
        joined = server.pool.get(bad[0].url)
        assert joined is not None and not joined.usable  # unchecked: not routed yet
        await server.pool.probe_all()
        assert any("VLLM_SERVER_DEV_MODE=1" in p for p in joined.problems)
        assert not joined.usable


def test_logits_modes_are_always_problems() -> None:
    for mode in ("raw_logits", "processed_logits"):
        caps = classify(
            scale_out=True,
            dev_mode=True,
            info=ServerInfo(logprobs_mode=mode),
            model="m",
            max_model_len=8,
            raw_logprobs="warn",
        )
        assert caps.problems and "logits" in caps.problems[0]


def test_server_info_parsing_reads_vllm_keys() -> None:
    body = {
        "vllm_config": {
            "model_config": {
                "logprobs_mode": "processed_logprobs",
                "max_model_len": 512,
                "served_model_name": ["tiny"],
            },
            "parallel_config": {"is_moe_model": True},
            "aux_output_config": {"enable_return_routed_experts": False},
        }
    }
    info = parse_server_info(body)
    assert info == ServerInfo("processed_logprobs", 512, True, False, "tiny")


def test_routed_experts_decision_for_dense_and_moe_engines() -> None:
    url = "http://e"
    assert EngineCapabilities().routed_experts_problem(url) is None  # unknown: the engine's reply decides
    assert "dense model" in (EngineCapabilities(is_moe=False).routed_experts_problem(url) or "")
    no_flag = EngineCapabilities(
        is_moe=True, routed_experts=False, routed_experts_flag="--enable-return-routed-experts"
    ).routed_experts_problem(url)
    assert no_flag is not None and "--enable-return-routed-experts" in no_flag and url in no_flag
    assert EngineCapabilities(is_moe=True, routed_experts=True).routed_experts_problem(url) is None
