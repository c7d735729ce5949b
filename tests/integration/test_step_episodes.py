"""Episodes inside RolloutStep (docs/episodes.md): a real gRPC replica on loopback, simulated
engines over real HTTP, and a real HTTP environment server (tests/support/env_server.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest

from rollout_grpc.client import make_sample, pb
from tests.harness import Harness, harness
from tests.support.env_server import GLUE, GuessEnv
from tests.support.service import PROMPT, SLOW_SIM, field_violation
from tests.support.steps import run_step

TURN = 8
#: Each model turn is exactly TURN tokens (ignore_eos), the whole episode at most 400.
PARAMS = {"temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True, "seed": 7}


def group(index: int, label: str) -> pb.PromptGroup:
    return pb.PromptGroup(prompt=make_sample(PROMPT, index=index * 10), group_index=index, label=label)


def episode(url: str, **kw: Any) -> dict[str, Any]:
    return {"url": url, "turnMaxNewTokens": TURN, **kw}


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with harness("sim") as running:
        yield running


async def tokenize(h: Harness, text: str) -> list[int]:
    """The simulated engine's own tokenisation of `text` (its /v1/completions/render)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{h.sims[0].url}/v1/completions/render", json={"prompt": text}) as response,
    ):
        return list((await response.json())[0]["token_ids"])


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal loss-mask values."""
    out: list[tuple[int, int, int]] = []
    for i, value in enumerate(mask):
        if out and out[-1][0] == value and out[-1][2] == i:
            out[-1] = (value, out[-1][1], i + 1)
        else:
            out.append((value, i, i + 1))
    return out


def assert_consistent(sample: pb.Sample) -> None:
    assert len(sample.tokens) == len(PROMPT) + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length


async def test_an_episode_is_one_sample_recorded_token_exactly(h: Harness) -> None:
    async with GuessEnv(done_after=3) as env:
        run = await run_step(
            h,
            [group(0, "after:3")],
            n_samples_per_prompt=2,
            params=PARAMS,
            episode=episode(env.url),
            filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
            step_id="ep1",
        )
        assert env.probes == 1, "the environment is probed once, at step start"
    [result] = run.groups
    assert result.outcome == pb.GROUP_OUTCOME_ACCEPTED, result.reason
    observation = [await tokenize(h, GLUE.format(f"turn {t} seen")) for t in range(2)]
    for sample in result.samples:
        assert_consistent(sample)
        mask = list(sample.loss_mask)
        response = list(sample.tokens[len(PROMPT) :])
        # three model turns of TURN tokens, the two observations between them, nothing else
        assert [(v, e - s) for v, s, e in runs(mask)] == [
            (1, TURN),
            (0, len(observation[0])),
            (1, TURN),
            (0, len(observation[1])),
            (1, TURN),
        ]
        model_turns = [(s, e) for v, s, e in runs(mask) if v == 1]
        for (_, s, e), expected in zip([r for r in runs(mask) if r[0] == 0], observation, strict=True):
            assert response[s:e] == expected, "the observation's tokens are the engine's tokenisation"
            assert list(sample.rollout_log_probs[s:e]) == [0.0] * (e - s)
        # weight-version spans cover exactly the generated positions
        covered = {p for span in sample.weight_versions for p in range(span.start, span.end)}
        assert covered == {p for s, e in model_turns for p in range(s, e)}
        # the environment saw each turn's text, in order, and the response is turns + observations
        requests = env.answers(f"ep1/g0/s{sample.index}")
        assert [r["turn"] for r in requests] == [0, 1, 2]
        assert {r["label"] for r in requests} == {"after:3"}
        text = "".join(
            r["action"] + (GLUE.format(f"turn {r['turn']} seen") if r["turn"] < 2 else "") for r in requests
        )
        assert sample.response == text
        assert sample.reward == float(sample.index % 2), "the environment's reward scores the episode"
        detail = dict(sample.reward_detail)
        assert detail["episode_end"] == "done" and detail["turns"] == 3
        assert detail["env_tokens"] == len(observation[0]) + len(observation[1])
        assert not sample.failure_reason
    assert run.summary is not None and run.summary.accepted == 1
    assert run.summary.progress.scored == 2


async def test_observation_ids_are_inserted_as_given(h: Harness) -> None:
    async with GuessEnv(done_after=2, observation_ids=[5, 6, 7]) as env:
        run = await run_step(
            h, [group(0, "x")], n_samples_per_prompt=1, params=PARAMS, episode=episode(env.url)
        )
    [sample] = run.groups[0].samples
    assert list(sample.loss_mask) == [1] * TURN + [0] * 3 + [1] * TURN
    assert list(sample.tokens[len(PROMPT) + TURN : len(PROMPT) + TURN + 3]) == [5, 6, 7]


async def test_the_guessing_game_ends_at_max_turns_with_its_last_reward(h: Harness) -> None:
    async with GuessEnv() as env:
        run = await run_step(
            h,
            [group(0, "987654321")],
            n_samples_per_prompt=2,
            params=PARAMS,
            episode=episode(env.url, maxTurns=3),
        )
        assert {r["turn"] for r in env.requests} == {0, 1, 2}
    [result] = run.groups
    assert result.outcome == pb.GROUP_OUTCOME_ACCEPTED
    for sample in result.samples:
        assert sample.reward == 0.0
        assert "max_turns" in sample.failure_reason
        assert dict(sample.reward_detail)["episode_end"] == "max_turns"
        assert sum(sample.loss_mask) == 3 * TURN


async def test_a_flaky_environment_is_retried(h: Harness) -> None:
    async with GuessEnv(done_after=2, mode="flaky") as env:
        run = await run_step(
            h, [group(0, "x")], n_samples_per_prompt=1, params=PARAMS, episode=episode(env.url)
        )
        assert [r["turn"] for r in env.requests] == [0, 0, 1, 1], "each 503 was retried once"
    assert run.groups[0].outcome == pb.GROUP_OUTCOME_ACCEPTED


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("down", "after 1 attempts"),
        ("slow", "after 1 attempts"),
        ("malformed", "`done` must be true or false"),
        ("not_json", "not JSON"),
        ("oversize", "over the 1048576 byte cap"),
        ("redirect", "redirects are not followed"),
    ],
)
async def test_an_environment_fault_keeps_every_turn_and_says_why(h: Harness, mode: str, why: str) -> None:
    async with GuessEnv(done_after=5, mode=mode, fail_from=1) as env:
        run = await run_step(
            h,
            [group(0, "x"), group(1, "y")],
            n_samples_per_prompt=2,
            params=PARAMS,
            episode=episode(env.url, maxRetries=0, timeoutS=0.5 if mode == "slow" else 30.0),
            reward={"onFailure": "REWARD_FAILURE_POLICY_DROP_GROUP"},
        )
    assert sorted(g.group_index for g in run.groups) == [0, 1], "every group is accounted for"
    for result in run.groups:
        assert result.outcome == pb.GROUP_OUTCOME_FAILED
        assert "environment" in result.reason and why in result.reason, result.reason
        assert len(result.samples) == 2
        for sample in result.samples:
            assert_consistent(sample)
            # turn 0, its observation, turn 1: every generated token kept
            assert [v for v, _, _ in runs(list(sample.loss_mask))] == [1, 0, 1]
            assert sum(sample.loss_mask) == 2 * TURN
            assert not sample.HasField("reward") and why in sample.reward_failure
            assert "environment_failed" in sample.failure_reason and "turn 1" in sample.failure_reason
            assert dict(sample.reward_detail)["episode_end"] == "environment_failed"
    assert run.summary is not None and run.summary.progress.dropped == {"reward_failed": 2}


async def test_an_environment_fault_fails_the_step_by_default(h: Harness) -> None:
    async with GuessEnv(done_after=5, mode="malformed", fail_from=0) as env:
        run = await run_step(
            h, [group(i, "x") for i in range(3)], n_samples_per_prompt=1, params=PARAMS, target_groups=1,
            max_groups_in_flight=1, episode=episode(env.url),
        )  # fmt: skip
    assert run.summary is not None and "on_failure FAIL_GROUP" in run.summary.reason
    assert run.groups[0].outcome == pb.GROUP_OUTCOME_FAILED
    reported = {g.group_index for g in run.groups} | set(run.summary.unstarted_group_indexes)
    assert reported == {0, 1, 2}, "every group is reported or returned unstarted"


async def test_an_unreachable_environment_is_refused_up_front(h: Harness) -> None:
    env = GuessEnv()
    async with env:
        url = env.url
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_step(h, [group(0, "x")], n_samples_per_prompt=1, params=PARAMS, episode=episode(url))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "episode.url" in (caught.value.details() or "")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"episode": {"url": "ftp://env"}}, "episode.url"),
        ({"episode": {"url": "http://127.0.0.1:1/env", "maxTurns": 0}}, "episode.max_turns"),
        ({"episode": {"url": "http://127.0.0.1:1/env", "maxTurns": 1000}}, "episode.max_turns"),
        (
            {"episode": {"url": "http://127.0.0.1:1/env", "turnMaxNewTokens": -1}},
            "episode.turn_max_new_tokens",
        ),
        ({"episode": {"url": "http://127.0.0.1:1/env", "timeoutS": 0}}, "episode.timeout_s"),
        ({"episode": {"url": "http://127.0.0.1:1/env", "timeoutS": "NaN"}}, "episode.timeout_s"),
        ({"episode": {"url": "http://127.0.0.1:1/env", "maxRetries": 11}}, "episode.max_retries"),
        ({"episode": {"url": "http://127.0.0.1:1/env", "maxConcurrency": 0}}, "episode.max_concurrency"),
        ({"params": {"temperature": 1.0}}, "sampling_params.max_new_tokens"),
        ({"reward": {"kind": "REWARD_KIND_MATH"}}, "reward.kind"),
        ({"options": {"mask_offpolicy": True}}, "options.mask_offpolicy"),
    ],
)
async def test_bad_episode_input_names_the_field(h: Harness, change: dict[str, Any], field: str) -> None:
    kw: dict[str, Any] = {"params": PARAMS, "episode": {"url": "http://127.0.0.1:1/env"}, **change}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_step(h, [group(0, "x")], n_samples_per_prompt=1, **kw)
    assert field_violation(caught.value) == field


async def test_a_partial_episode_cannot_be_sent_back(h: Harness) -> None:
    partial = make_sample(PROMPT, index=0)
    partial.status = pb.SAMPLE_STATUS_ABORTED
    bad = pb.PromptGroup(prompt=make_sample(PROMPT), group_index=0, partial=[partial])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_step(
            h, [bad], n_samples_per_prompt=1, params=PARAMS, episode={"url": "http://127.0.0.1:1/e"}
        )
    assert field_violation(caught.value) == "groups[0].partial"


async def test_an_environment_outside_the_allowlist_is_refused() -> None:
    async with harness("sim", env_urls=["http://127.0.0.1:1/env"]) as h:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_step(
                h,
                [group(0, "x")],
                n_samples_per_prompt=1,
                params=PARAMS,
                episode={"url": "http://127.0.0.1:2/env"},
            )
        assert field_violation(caught.value) == "episode.url"
        assert "--env-url" in (caught.value.details() or "")


async def test_a_stopped_episode_is_buffered_and_continued_exactly() -> None:
    async with harness("sim", sim_config=SLOW_SIM) as h, GuessEnv() as env:
        first = await run_step(
            h, [group(0, "after:1"), group(1, "after:6")], n_samples_per_prompt=2, params=PARAMS,
            target_groups=1, max_groups_in_flight=2, over_sampling="keep_in_flight", leftovers="buffer",
            episode=episode(env.url),
            step_id="a",
        )  # fmt: skip
        assert first.group(0).outcome == pb.GROUP_OUTCOME_ACCEPTED
        assert first.group(1).outcome == pb.GROUP_OUTCOME_BUFFERED
        before = {i: [r["turn"] for r in env.answers(f"a/g1/s{i}")] for i in (0, 1)}
        assert all(len(turns) < 6 for turns in before.values()), "stopped mid-episode"
        second = await run_step(
            h, [], n_samples_per_prompt=2, params=PARAMS, continue_buffered=True, episode=episode(env.url),
            step_id="b",
        )  # fmt: skip
    [result] = second.groups
    assert result.group_index == 1 and result.outcome == pb.GROUP_OUTCOME_ACCEPTED, result.reason
    for sample in result.samples:
        assert_consistent(sample)
        requests = env.answers(f"a/g1/s{sample.index - 10}")
        # turns continue where they stopped (a turn stopped before its answer is asked again)
        assert sorted({r["turn"] for r in requests}) == list(range(6))
        asked = Counter(r["turn"] for r in requests)
        assert sum(n - 1 for n in asked.values()) <= 1, "only a turn stopped before its answer is re-sent"
        assert dict(sample.reward_detail)["episode_end"] == "done"
        assert dict(sample.reward_detail)["turns"] == 6
        assert sample.start_step_id == "a"
        assert [v for v, _, _ in runs(list(sample.loss_mask))] == [1, 0] * 5 + [1]
        assert sum(sample.loss_mask) == 6 * TURN, "the stopped turn was continued, not restarted"
