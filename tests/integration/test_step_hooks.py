"""RolloutStep hooks on the simulator with real servers: per-group sampling parameters, reward and
filter plugins from a really installed entry point (a `.dist-info` on sys.path), and a remote filter
on a real aiohttp server; every fault (plugin raising, unknown plugin, filter down, slow or
malformed) accounts for every sample."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout_grpc.client import make_sample, pb, prompt_group
from rollout_grpc.server.rollout.step.plugins import PluginError, StepPlugins
from tests.harness import Harness, harness
from tests.support.service import PROMPT, field_violation
from tests.support.step_plugins import FilterServer, installed_plugins
from tests.support.steps import StepRun, run_step

SHORT = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "seed": 100}
N = 4


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = installed_plugins(tmp_path)
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.fixture
async def h(plugin_path: Path) -> AsyncIterator[Harness]:
    async with harness("sim", sim_count=1, step_plugins=["*"]) as running:
        yield running


def groups(labels: list[str]) -> list[pb.PromptGroup]:
    return [
        pb.PromptGroup(prompt=make_sample([*PROMPT, 500 + i], index=i * N), group_index=i, label=label)
        for i, label in enumerate(labels)
    ]


def assert_every_sample(run: StepRun, started: int) -> None:
    """Each started group is reported once with its n samples, each holding its generated tokens."""
    assert run.summary is not None
    reported = [g.group_index for g in run.groups]
    assert len(reported) == len(set(reported)) == started
    for group in run.groups:
        assert len(group.samples) == N, group
        for sample in group.samples:
            assert len(sample.tokens) == len(PROMPT) + 1 + sample.response_length


async def test_reward_and_filter_plugins_of_an_installed_distribution(h: Harness) -> None:
    run = await run_step(
        h,
        groups(["keep", "other", "keep"]),
        n_samples_per_prompt=N,
        params=SHORT,
        reward={"kind": "REWARD_KIND_PLUGIN", "plugin": "label_reward"},
        filter={"kind": "FILTER_KIND_PLUGIN", "plugin": "label_filter"},
    )
    assert run.outcomes() == {
        0: pb.GROUP_OUTCOME_ACCEPTED,
        1: pb.GROUP_OUTCOME_FILTERED,
        2: pb.GROUP_OUTCOME_ACCEPTED,
    }
    assert "label_filter" in run.group(1).reason and "'other' is not keep" in run.group(1).reason
    for sample in run.group(0).samples:
        assert sample.reward == 1.0 and sample.reward_detail["by"] == "plugin"
    assert_every_sample(run, 3)
    assert run.summary is not None and run.summary.accepted == 2


async def test_an_async_reward_plugin_scores_every_sample(h: Harness) -> None:
    run = await run_step(
        h, groups(["a"]), n_samples_per_prompt=N, params=SHORT,
        reward={"kind": "REWARD_KIND_PLUGIN", "plugin": "async_reward"},
    )  # fmt: skip
    assert [s.reward for s in run.group(0).samples] == [0.25] * N


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"reward": {"kind": "REWARD_KIND_PLUGIN", "plugin": "nope"}}, "reward.plugin"),
        ({"reward": {"kind": "REWARD_KIND_PLUGIN"}}, "reward.plugin"),
        ({"filter": {"kind": "FILTER_KIND_PLUGIN", "plugin": "nope"}}, "filter.plugin"),
        ({"filter": {"kind": "FILTER_KIND_PLUGIN", "plugin": "label_reward"}}, "filter.plugin"),
        ({"filter": {"plugin": "label_filter"}}, "filter.plugin"),
        ({"filter": {"kind": "FILTER_KIND_REMOTE"}}, "filter.url"),
        ({"filter": {"kind": "FILTER_KIND_REMOTE", "url": "ftp://x/f"}}, "filter.url"),
    ],
)
async def test_an_unknown_plugin_or_bad_hook_is_refused_naming_the_field(
    h: Harness, request_fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(h, groups(["a"]), n_samples_per_prompt=N, params=SHORT, **request_fields)
    assert field_violation(err.value) == field


async def test_a_plugin_installed_but_not_enabled_is_unknown(plugin_path: Path) -> None:
    async with harness("sim", sim_count=1, step_plugins=["label_reward"]) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run_step(
                h, groups(["a"]), n_samples_per_prompt=N, params=SHORT,
                reward={"kind": "REWARD_KIND_PLUGIN", "plugin": "boom_reward"},
            )  # fmt: skip
    assert field_violation(err.value) == "reward.plugin"
    assert "enabled: label_reward" in (err.value.details() or "")


def test_enabling_a_plugin_that_is_not_installed_stops_the_start(plugin_path: Path) -> None:
    with pytest.raises(PluginError, match=r"--step-plugin: no installed plugin named 'nope'.*label_reward"):
        StepPlugins.load(["nope"])
    assert StepPlugins.load([]).rewards == {}


@pytest.mark.parametrize(
    ("plugin", "why"), [("boom_reward", "the grader exploded"), ("text_reward", "'high'")]
)
async def test_a_failing_reward_plugin_fails_the_group_with_every_sample(
    h: Harness, plugin: str, why: str
) -> None:
    run = await run_step(
        h, groups(["a", "b"]), n_samples_per_prompt=N, params=SHORT, target_groups=1, max_groups_in_flight=1,
        reward={"kind": "REWARD_KIND_PLUGIN", "plugin": plugin},
    )  # fmt: skip
    failed = run.group(0)
    assert failed.outcome == pb.GROUP_OUTCOME_FAILED and plugin in failed.reason
    assert all(why in s.reward_failure and not s.HasField("reward") for s in failed.samples)
    assert run.summary is not None and not run.summary.target_reached and "reward" in run.summary.reason
    assert_every_sample(run, 1)


async def test_a_raising_filter_plugin_fails_the_group_and_stops_the_step(h: Harness) -> None:
    run = await run_step(
        h, groups(["a", "b", "c"]), n_samples_per_prompt=N, params=SHORT, max_groups_in_flight=1,
        over_sampling="keep_in_flight", filter={"kind": "FILTER_KIND_PLUGIN", "plugin": "boom_filter"},
    )  # fmt: skip
    assert run.group(0).outcome == pb.GROUP_OUTCOME_FAILED
    assert "the filter failed: filter plugin 'boom_filter' raised ValueError('the filter exploded')" in (
        run.group(0).reason
    )
    assert run.summary is not None and run.summary.reason.startswith("the filter failed")
    assert list(run.summary.unstarted_group_indexes) == [1, 2]
    assert_every_sample(run, 1)


async def test_a_filter_plugin_returning_nothing_is_a_failure_not_a_keep(h: Harness) -> None:
    run = await run_step(
        h, groups(["a"]), n_samples_per_prompt=N, params=SHORT,
        filter={"kind": "FILTER_KIND_PLUGIN", "plugin": "none_filter"},
    )  # fmt: skip
    assert run.group(0).outcome == pb.GROUP_OUTCOME_FAILED and "returned None" in run.group(0).reason


async def test_a_remote_filter_keeps_and_drops_groups(h: Harness) -> None:
    async with FilterServer() as remote:
        run = await run_step(
            h, groups(["keep", "other"]), n_samples_per_prompt=N, params=SHORT,
            filter={"kind": "FILTER_KIND_REMOTE", "url": remote.url},
        )  # fmt: skip
    assert run.outcomes() == {0: pb.GROUP_OUTCOME_ACCEPTED, 1: pb.GROUP_OUTCOME_FILTERED}
    assert run.group(1).reason == "label other"
    by_group = {r["group_index"]: r for r in remote.requests}
    assert sorted(by_group) == [0, 1]
    sent = by_group[0]
    assert sent["responses"] == [s.response for s in run.group(0).samples]
    assert sent["statuses"] == ["truncated"] * N and sent["rewards"] == [None] * N
    assert_every_sample(run, 2)


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("malformed", "boolean 'keep'"),
        ("hang", "after 1 attempts"),
        ("error", "HTTP 500 after 2 attempts"),
    ],
)
async def test_a_remote_filter_that_misbehaves_fails_the_group_with_every_sample(
    h: Harness, mode: str, why: str
) -> None:
    async with FilterServer(mode) as remote:
        retries = 1 if mode == "error" else 0
        run = await run_step(
            h, groups(["keep", "keep"]), n_samples_per_prompt=N, params=SHORT, max_groups_in_flight=1,
            over_sampling="keep_in_flight",
            filter={
                "kind": "FILTER_KIND_REMOTE", "url": remote.url, "timeout_s": 0.5, "max_retries": retries
            },
        )  # fmt: skip
    failed = run.group(0)
    assert failed.outcome == pb.GROUP_OUTCOME_FAILED and why in failed.reason, failed.reason
    assert remote.url in failed.reason
    assert run.summary is not None and run.summary.reason.startswith("the filter failed")
    assert_every_sample(run, 1)


async def test_a_remote_filter_that_is_down_is_refused_at_start(h: Harness) -> None:
    async with FilterServer() as remote:
        url = remote.url
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(
            h, groups(["a"]), n_samples_per_prompt=N, params=SHORT,
            filter={"kind": "FILTER_KIND_REMOTE", "url": url},
        )  # fmt: skip
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "filter.url" in (err.value.details() or "")


async def test_a_remote_filter_outside_the_allowlist_is_refused(plugin_path: Path) -> None:
    async with (
        FilterServer() as remote,
        harness("sim", sim_count=1, reward_urls=["http://127.0.0.1:1/only"]) as h,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run_step(
                h, groups(["a"]), n_samples_per_prompt=N, params=SHORT,
                filter={"kind": "FILTER_KIND_REMOTE", "url": remote.url},
            )  # fmt: skip
        assert remote.requests == []
    assert field_violation(err.value) == "filter.url"


async def test_a_group_with_its_own_sampling_params(h: Harness) -> None:
    eval_params = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
    run = await run_step(
        h,
        [
            prompt_group(make_sample([*PROMPT, 1], index=0), 0, "train"),
            prompt_group(make_sample([*PROMPT, 2], index=N), 1, "eval", params=eval_params),
        ],
        n_samples_per_prompt=N,
        params=SHORT,
    )
    assert {s.response_length for s in run.group(0).samples} == {6}
    assert {s.response_length for s in run.group(1).samples} == {3}
    greedy = {tuple(s.tokens) for s in run.group(1).samples}
    assert len(greedy) == 1, "temperature 0: every sample of the eval group is the same"
    assert len({tuple(s.tokens) for s in run.group(0).samples}) > 1


async def test_bad_group_sampling_params_are_refused_naming_the_group(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(
            h,
            [
                prompt_group(make_sample(PROMPT, index=0), 0),
                prompt_group(make_sample(PROMPT, index=N), 1, params={"temperature": -1.0}),
            ],
            n_samples_per_prompt=N,
            params=SHORT,
        )
    assert field_violation(err.value) == "groups[1].sampling_params.temperature"
