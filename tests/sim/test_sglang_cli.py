"""``rollout-grpc sim --kind sglang``: the flags reach the SGLang personality's configuration and the
app it builds answers SGLang's routes, not vLLM's."""

from __future__ import annotations

import aiohttp

from rollout_grpc.sim import SimEngine
from rollout_grpc.sim.__main__ import build_parser, config_from_args
from tests.support.sim_http import get, post


def test_sglang_flags_build_the_sglang_config() -> None:
    argv = [
        "--kind",
        "sglang",
        "--incremental-streaming-output",
        "--weight-version",
        "w7",
        "--stream-interval",
        "4",
    ]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.kind == "sglang"
    assert cfg.sglang.incremental_streaming_output is True
    assert (cfg.sglang.weight_version, cfg.sglang.stream_interval) == ("w7", 4)
    assert config_from_args(build_parser().parse_args([])).kind == "vllm"


async def test_the_sglang_app_serves_sglang_routes_only(session: aiohttp.ClientSession) -> None:
    cfg = config_from_args(build_parser().parse_args(["--kind", "sglang", "--weight-version", "w7"]))
    async with SimEngine(cfg) as eng:
        info = await get(session, eng.url + "/get_server_info")
        vllm_route = await post(session, eng.url + "/inference/v1/generate", {"token_ids": [1, 2]})
    assert info.status == 200 and info.json["weight_version"] == "w7"
    assert vllm_route.status == 404
