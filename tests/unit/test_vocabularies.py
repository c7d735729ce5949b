"""Each closed vocabulary is named once (`domain/vocabulary.py`, `rewards/api.RewardKind`) and
every place that speaks it covers every member: a member added in one place and forgotten in
another fails here, before a caller meets the gap."""

from __future__ import annotations

import aiohttp
import pytest

from rollout_grpc import settings
from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain.vocabulary import DEFAULT_ENGINE_KIND, EngineKind, PauseMode
from rollout_grpc.server.engines import registry
from rollout_grpc.server.engines.sglang import adapter as sglang_adapter
from rollout_grpc.server.front.grpc import convert, service
from rollout_grpc.server.rewards.api import RewardKind
from rollout_grpc.server.rollout import control

# ------------------------------------------------------------------------------------- engine kinds


def test_every_engine_kind_has_an_adapter_and_nothing_else_does() -> None:
    assert set(registry.KINDS) == set(EngineKind)
    assert registry.DEFAULT_KIND is DEFAULT_ENGINE_KIND


@pytest.mark.parametrize("kind", list(EngineKind))
async def test_an_engine_url_of_every_kind_gets_that_kinds_adapter(kind: EngineKind) -> None:
    """From the settings' `KIND+` prefix to the adapter the pool builds."""
    engine = settings.parse_engine_url(f"{kind.value}+http://engine-0:8000")
    assert engine.kind is kind
    async with aiohttp.ClientSession() as http:
        adapter = registry.adapter_factory(http, kinds=settings.engine_kinds([engine]))(engine.url)
    assert adapter.kind == kind.value


def test_an_unknown_engine_kind_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="vllm") as info:
        settings.parse_engine_url("tgi+http://engine-0:8000")
    assert all(kind.value in str(info.value) for kind in EngineKind)


# ------------------------------------------------------------------------------------- pause modes


def test_the_proto_pause_modes_are_the_domains() -> None:
    names = {v.name.removeprefix("PAUSE_MODE_") for v in pb.PauseMode.DESCRIPTOR.values if v.number != 0}
    assert names == {mode.name for mode in PauseMode}
    assert set(service._PAUSE_MODES.values()) == set(PauseMode)


def test_fleet_control_and_every_engine_kind_take_every_pause_mode() -> None:
    assert set(control.PAUSE_MODES) == set(PauseMode)
    assert set(sglang_adapter.PAUSE_MODES) == set(PauseMode)


# ------------------------------------------------------------------------------------- reward kinds


def test_the_proto_reward_kinds_map_by_name() -> None:
    names = {v.name.removeprefix("REWARD_KIND_") for v in pb.RewardKind.DESCRIPTOR.values if v.number != 0}
    assert names == {kind.name for kind in RewardKind if kind is not RewardKind.NONE}
    assert set(convert._REWARD_KINDS.values()) == set(RewardKind)


def test_an_unset_reward_option_takes_the_reward_configs_default() -> None:
    """The gRPC door used to repeat RewardConfig's defaults (30 s, 2 retries, 32 at once)."""
    from dataclasses import replace

    from rollout_grpc.server.domain.model import GenerateOptions
    from rollout_grpc.server.rewards.api import RewardConfig

    request = pb.RolloutStepRequest(
        step_id="s",
        groups=[pb.PromptGroup(prompt=pb.Sample(tokens=[1]))],
        n_samples_per_prompt=1,
        target_groups=1,
        reward=pb.RewardSpec(kind=pb.REWARD_KIND_MATH),
    )
    got = convert.step_spec_from_pb(request, GenerateOptions()).reward
    assert got == replace(RewardConfig(), kind=RewardKind.MATH)
    request.reward.timeout_s, request.reward.max_retries = 5.0, 0
    got = convert.step_spec_from_pb(request, GenerateOptions()).reward
    assert (got.timeout_s, got.max_retries, got.max_concurrency) == (5.0, 0, RewardConfig().max_concurrency)
