"""RolloutStep end to end: a real gRPC replica on loopback, simulated engines over real HTTP and a
real HTTP reward model (tests/support/reward_server.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from rollout_grpc.client import RolloutClient, make_sample, pb
from rollout_grpc.server.facade.calls import CallRecord
from tests.harness import Harness, harness
from tests.support.partials import aborted_partials
from tests.support.reward_server import RewardServer
from tests.support.service import PROMPT, SLOW_SIM, engine_id, field_violation
from tests.support.steps import StepRun, run_step


def prompt(index: int = 0) -> pb.Sample:
    return make_sample(PROMPT, index=index)


def assert_consistent(sample: pb.Sample) -> None:
    """The sample's own invariants: one logprob and one mask entry per response token."""
    assert len(sample.tokens) == len(PROMPT) + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length


SHORT = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "seed": 100}


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with harness("sim", sim_count=2) as running:
        yield running


@pytest.fixture
async def slow() -> AsyncIterator[Harness]:
    async with harness("sim", sim_config=SLOW_SIM) as running:
        yield running


async def test_a_group_is_n_samples_with_indexes_seeds_and_one_session_key(h: Harness) -> None:
    run = await run_step(
        h, [(prompt(10), 7)], n_samples_per_prompt=4, params=SHORT, stream_samples=True, step_id="s1"
    )
    [group] = run.groups
    assert group.outcome == pb.GROUP_OUTCOME_ACCEPTED and group.group_index == 7
    assert sorted(s.index for s in group.samples) == [10, 11, 12, 13]
    assert {s.group_index for s in group.samples} == {7}
    assert len({s.session_id for s in group.samples}) == 1, "one session key pins the group"
    # seed = base + i: different samples, reproducible per position
    assert len({tuple(s.tokens) for s in group.samples}) > 1
    assert {s.start_step_id for s in group.samples} == {"s1"}
    for sample in group.samples:
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 6
        assert not sample.HasField("reward")
        assert_consistent(sample)
    assert sorted(s.index for s in run.samples) == [10, 11, 12, 13]
    again = await run_step(h, [(prompt(10), 7)], n_samples_per_prompt=4, params=SHORT, step_id="s2")
    tokens = {s.index: list(s.tokens) for s in group.samples}
    assert {s.index: list(s.tokens) for s in again.groups[0].samples} == tokens
    assert run.summary is not None and run.summary.target_reached and run.summary.accepted == 1


async def test_over_sampling_past_filtered_groups_with_a_remote_reward(h: Harness) -> None:
    async with RewardServer() as rm:
        labels = ["one", "alternate", "one", "alternate", "one", "alternate"]
        groups = [
            pb.PromptGroup(prompt=prompt(i * 4), group_index=i, label=label) for i, label in enumerate(labels)
        ]
        run = await run_step(
            h,
            groups,
            n_samples_per_prompt=4,
            params=SHORT,
            target_groups=2,
            max_groups_in_flight=3,
            over_sampling="keep_in_flight",  # refill after each filtered group
            reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url},
            filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
        )
        assert rm.probes == 1, "the reward URL is probed once, at step start"
    accepted = run.by_outcome(pb.GROUP_OUTCOME_ACCEPTED)
    assert len(accepted) == 2
    for group in accepted:
        assert labels[group.group_index] == "alternate"
        assert sorted(s.reward for s in group.samples) == [0.0, 0.0, 1.0, 1.0]
        assert list(group.version_lag) == [0, 0, 0, 0]
    for group in run.by_outcome(pb.GROUP_OUTCOME_FILTERED):
        assert labels[group.group_index] == "one"
        assert "reward std 0" in group.reason
    reported = [g.group_index for g in run.groups]
    assert len(reported) == len(set(reported)), "every group is reported once"
    assert run.summary is not None and run.summary.target_reached and run.summary.accepted == 2
    assert set(reported) | set(run.summary.unstarted_group_indexes) == set(range(6))
    assert run.summary.progress.dropped.get("filter", 0) == len(run.by_outcome(pb.GROUP_OUTCOME_FILTERED))
    assert run.summary.progress.dropped.get("filter", 0) >= 1, "the filtered group was sampled past"


def nearly_done(index: int, n: int, done: int) -> list[pb.Sample]:
    """ABORTED partial samples with `done` response tokens (what a previous step returned)."""
    return aborted_partials(PROMPT, index, n, done)


LONG_STEP = {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True}


async def step_with_leftovers(h: Harness, leftovers: str) -> StepRun:
    """Step "a": group 0 needs 5 more tokens and is accepted at once; groups 1 and 2 (300 tokens
    each) are still generating when the target of one group is reached."""
    quick = pb.PromptGroup(prompt=prompt(0), group_index=0, partial=nearly_done(0, 2, 295))
    return await run_step(
        h,
        [quick, (prompt(2), 1), (prompt(4), 2)],
        n_samples_per_prompt=2,
        params=LONG_STEP,
        target_groups=1,
        max_groups_in_flight=3,
        over_sampling="keep_in_flight",  # all three start at once
        leftovers=leftovers,
        step_id="a",
    )


async def test_leftovers_are_aborted_with_their_tokens_and_continue_with_the_exact_budget(
    slow: Harness,
) -> None:
    first = await step_with_leftovers(slow, "return")
    [accepted] = first.by_outcome(pb.GROUP_OUTCOME_ACCEPTED)
    assert accepted.group_index == 0
    assert {s.start_step_id for s in accepted.samples} == {"earlier"}
    assert all(s.response_length == 300 for s in accepted.samples)
    leftovers = first.by_outcome(pb.GROUP_OUTCOME_ABORTED)
    assert sorted(g.group_index for g in leftovers) == [1, 2]
    for group in leftovers:
        assert "target" in group.reason
        for sample in group.samples:
            assert sample.status == pb.SAMPLE_STATUS_ABORTED and 0 < sample.response_length < 300
            assert_consistent(sample)
    # The trainer sends them back: each continues with max_new_tokens - response_length.
    again = [
        pb.PromptGroup(prompt=prompt(2 * g.group_index), group_index=g.group_index, partial=g.samples)
        for g in leftovers
    ]
    second = await run_step(
        slow, again, n_samples_per_prompt=2, params=LONG_STEP, options={"mask_offpolicy": True}, step_id="b"
    )
    assert len(second.by_outcome(pb.GROUP_OUTCOME_ACCEPTED)) == 2
    before = {(g.group_index, s.index): s for g in leftovers for s in g.samples}
    for group in second.groups:
        for sample in group.samples:
            old = before[(group.group_index, sample.index)]
            assert sample.response_length == 300
            assert list(sample.tokens[: len(old.tokens)]) == list(old.tokens), "no token lost"
            assert list(sample.rollout_log_probs[: old.response_length]) == list(old.rollout_log_probs)
            assert list(sample.loss_mask) == [0] * old.response_length + [1] * (300 - old.response_length)
            assert sample.start_step_id == "a"


async def test_buffered_leftovers_are_continued_first_by_the_next_step(slow: Harness) -> None:
    first = await step_with_leftovers(slow, "buffer")
    buffered = first.by_outcome(pb.GROUP_OUTCOME_BUFFERED)
    assert sorted(g.group_index for g in buffered) == [1, 2] and not any(g.samples for g in buffered)
    assert first.summary is not None and first.summary.buffered == 2
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a group index the buffer already holds
        await run_step(
            slow, [(prompt(8), 1)], n_samples_per_prompt=2, params=LONG_STEP, continue_buffered=True
        )
    assert field_violation(err.value) == "groups[0].group_index"
    second = await run_step(
        slow,
        [(prompt(8), 9)],
        n_samples_per_prompt=2,
        params=LONG_STEP,
        continue_buffered=True,
        max_groups_in_flight=1,  # one group at a time: the order they run in is the order they end in
        step_id="b",
    )
    accepted = second.by_outcome(pb.GROUP_OUTCOME_ACCEPTED)
    # Buffered oldest first: in the order the first step ended (and reported) them, which on a
    # loaded machine need not be their index order.
    assert [g.group_index for g in accepted] == [g.group_index for g in buffered] + [9], (
        "the buffered groups first, oldest first"
    )
    for group in accepted:
        assert all(s.response_length == 300 for s in group.samples)
        assert {s.start_step_id for s in group.samples} == {"b" if group.group_index == 9 else "a"}
    assert second.summary is not None and second.summary.buffered == 0


async def test_a_reward_server_that_dies_mid_step_loses_no_token(slow: Harness) -> None:
    async with RewardServer() as rm:
        groups = [pb.PromptGroup(prompt=prompt(2 * i), group_index=i, label="alternate") for i in range(3)]
        quick = pb.PromptGroup(
            prompt=prompt(10), group_index=5, label="alternate", partial=nearly_done(10, 2, 298)
        )
        events: list[pb.RolloutStepResponse] = []
        async for event in slow.client.rollout_step(
            [quick, *groups],
            n_samples_per_prompt=2,
            params=LONG_STEP,
            reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url, "max_retries": 1},
            stream_samples=True,
            timeout=120,
        ):
            events.append(event)
            if event.WhichOneof("event") == "group" and event.group.group_index == 5:
                await rm.stop()
    by_kind: dict[str, list[Any]] = {}
    for event in events:
        by_kind.setdefault(event.WhichOneof("event") or "", []).append(
            getattr(event, event.WhichOneof("event") or "")
        )
    groups_out = {g.group_index: g for g in by_kind["group"]}
    assert groups_out[5].outcome == pb.GROUP_OUTCOME_ACCEPTED
    failed = [g for g in groups_out.values() if g.outcome == pb.GROUP_OUTCOME_FAILED]
    assert failed, "a reward failure is explicit"
    for group in failed:
        assert "reward" in group.reason
        assert any(s.reward_failure and not s.HasField("reward") for s in group.samples)
    summary = by_kind["summary"][0]
    assert "reward" in summary.reason and not summary.target_reached
    # every generated sample is in a group result with the tokens it was streamed with
    streamed = {(s.group_index, s.index): list(s.tokens) for s in by_kind["sample"]}
    returned = {(g.group_index, s.index): list(s.tokens) for g in groups_out.values() for s in g.samples}
    assert set(groups_out) == {0, 1, 2, 5}
    for key, tokens in returned.items():
        assert streamed.get(key, tokens) == tokens
    for group in groups_out.values():
        for sample in group.samples:
            assert_consistent(sample)
            if group.outcome == pb.GROUP_OUTCOME_ABORTED:
                assert sample.status in (pb.SAMPLE_STATUS_ABORTED, pb.SAMPLE_STATUS_TRUNCATED)


async def test_abort_mine_mid_step_ends_it_with_every_token(slow: Harness) -> None:
    seen_tokens = False
    run = StepRun()
    async for event in slow.client.rollout_step(
        [(prompt(0), 0), (prompt(2), 1)],
        n_samples_per_prompt=2,
        params={**LONG_STEP, "max_new_tokens": 3000},
        step_id="m",
        timeout=120,
    ):
        kind = event.WhichOneof("event")
        if not seen_tokens:
            seen_tokens = True
            await slow.sims[0].wait_for_tokens(engine_id(slow.server, "m/g1/s1"), 5)
            response = await slow.client.abort(mine=True)
            assert response.aborted == 4
        if kind == "group":
            run.groups.append(event.group)
        elif kind == "summary":
            run.summary = event.summary
    assert sorted(g.group_index for g in run.groups) == [0, 1]
    for group in run.groups:
        assert group.outcome == pb.GROUP_OUTCOME_ABORTED
        for sample in group.samples:
            assert sample.status == pb.SAMPLE_STATUS_ABORTED and sample.response_length >= 1
            assert_consistent(sample)
    assert run.summary is not None and "Abort mine" in run.summary.reason


async def test_a_trainer_that_leaves_mid_step_finds_its_groups_in_its_buffer(slow: Harness) -> None:
    stream = slow.client.rollout_step(
        [(prompt(0), 0), (prompt(2), 1)],
        n_samples_per_prompt=2,
        params={**LONG_STEP, "max_new_tokens": 3000},
        step_id="gone",
        timeout=120,
    )
    await stream.__anext__()
    await slow.sims[0].wait_for_tokens(engine_id(slow.server, "gone/g1/s1"), 5)
    await stream.aclose()  # the trainer goes away
    core = slow.sims[0].core
    await core.wait_until(lambda: not core.running)  # the replica aborted the step's samples
    resumed = await run_step(
        slow, [], n_samples_per_prompt=2, params={**LONG_STEP, "max_new_tokens": 40}, continue_buffered=True
    )
    assert sorted(g.group_index for g in resumed.groups) == [0, 1]
    for group in resumed.groups:
        assert group.outcome == pb.GROUP_OUTCOME_ACCEPTED
        for sample in group.samples:
            assert sample.start_step_id == "gone"
            assert_consistent(sample)
            assert sample.response_length >= 5


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"n_samples_per_prompt": 0}, "n_samples_per_prompt"),
        ({"n_samples_per_prompt": 65}, "n_samples_per_prompt"),
        ({"target_groups": 3}, "target_groups"),
        ({"reward": {"kind": 42}}, "reward.kind"),
        ({"filter": {"kind": 9}}, "filter.kind"),
        ({"filter": {"kind": "FILTER_KIND_REWARD_NONZERO_STD"}}, "filter.kind"),
        ({"reward": {"kind": "REWARD_KIND_REMOTE", "url": "ftp://x"}}, "reward.url"),
        ({"step_id": "bad id"}, "step_id"),
        ({"max_staleness": -1}, "max_staleness"),
    ],
)
async def test_bad_input_is_refused_before_anything_generates(
    h: Harness, kw: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {"n_samples_per_prompt": 2, "params": SHORT, **kw}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(h, [(prompt(0), 0)], **args)
    assert field_violation(err.value) == field
    assert sum(s.stats.generate_requests for s in h.sims) == 0


async def refused_remote_reward_step(h: Harness, url: str) -> grpc.aio.AioRpcError:
    """The error of a one-group step (2 samples) scored by the REMOTE reward at `url`."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(
            h,
            [(prompt(0), 0)],
            n_samples_per_prompt=2,
            params=SHORT,
            reward={"kind": "REWARD_KIND_REMOTE", "url": url},
        )
    return err.value


async def test_an_unreachable_reward_url_fails_the_probe(h: Harness) -> None:
    async with RewardServer() as rm:
        url = rm.url
    error = await refused_remote_reward_step(h, url)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "reward" in (error.details() or "")


def versioned(index: int, version: str, done: int = 290) -> list[pb.Sample]:
    """Partial samples whose tokens were generated under `version`."""
    samples = nearly_done(index, 2, done)
    for sample in samples:
        sample.weight_versions.add(version=version, start=0, end=done)
    return samples


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
async def test_a_sample_over_max_staleness_is_dropped_or_regenerated(h: Harness, policy: str) -> None:
    for version in ("1", "2", "3"):
        await h.client.resume(version)
    old = pb.PromptGroup(prompt=prompt(0), group_index=0, partial=versioned(0, "1"))
    fresh = pb.PromptGroup(prompt=prompt(2), group_index=1, partial=versioned(2, "3"))
    run = await run_step(
        h,
        [old, fresh],
        n_samples_per_prompt=2,
        params={**LONG_STEP, "max_new_tokens": 295},
        max_staleness=1,
        on_stale=policy,
    )
    results = {(g.group_index, g.outcome): g for g in run.groups}
    stale = results[(0, pb.GROUP_OUTCOME_STALE)]
    assert "2 weight versions behind" in stale.reason and list(stale.version_lag) == [2, 2]
    assert list(results[(1, pb.GROUP_OUTCOME_ACCEPTED)].version_lag) == [0, 0]
    assert run.summary is not None and run.summary.progress.dropped["stale"] == 1
    if policy == "regenerate":
        again = results[(0, pb.GROUP_OUTCOME_ACCEPTED)]
        assert all(s.response_length == 295 and s.weight_versions[0].version == "3" for s in again.samples)
        assert list(again.version_lag) == [0, 0]
    else:
        assert (0, pb.GROUP_OUTCOME_ACCEPTED) not in results


async def test_abort_all_mid_step_stops_it_and_loses_no_token(slow: Harness) -> None:
    run = StepRun()
    aborted = False
    async for event in slow.client.rollout_step(
        [(prompt(0), 0), (prompt(2), 1), (prompt(4), 2)],
        n_samples_per_prompt=2,
        params={**LONG_STEP, "max_new_tokens": 3000},
        max_groups_in_flight=2,
        stream_samples=True,
        step_id="all",
        timeout=120,
    ):
        if not aborted:
            aborted = True
            await slow.sims[0].wait_for_tokens(engine_id(slow.server, "all/g1/s1"), 5)
            assert (await slow.client.abort(all=True)).aborted == 4
        kind = event.WhichOneof("event")
        if kind == "group":
            run.groups.append(event.group)
        elif kind == "sample":
            run.samples.append(event.sample)
        elif kind == "summary":
            run.summary = event.summary
    assert sorted(g.group_index for g in run.groups) == [0, 1]
    streamed = {(s.group_index, s.index): list(s.tokens) for s in run.samples}
    for group in run.groups:
        assert group.outcome == pb.GROUP_OUTCOME_ABORTED
        for sample in group.samples:
            assert sample.status == pb.SAMPLE_STATUS_ABORTED and sample.response_length >= 1
            assert streamed[(group.group_index, sample.index)] == list(sample.tokens)
            assert_consistent(sample)
    assert run.summary is not None and "Abort all" in run.summary.reason
    assert list(run.summary.unstarted_group_indexes) == [2]


async def test_a_group_reward_posts_slimes_shape_one_request_per_sample_by_default(h: Harness) -> None:
    """slime's group RM over remote_rm sends one `{prompt, response, label}` per sample: a slime
    reward server (which knows no batch shape) works unchanged."""
    async with RewardServer(per_sample_only=True) as rm:
        run = await run_step(
            h,
            [pb.PromptGroup(prompt=prompt(0), group_index=0, label="parity")],
            n_samples_per_prompt=3,
            params=SHORT,
            reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url, "scope": "REWARD_SCOPE_GROUP"},
        )
        assert len(rm.requests) == 3
        assert all(set(r) == {"prompt", "response", "label"} for r in rm.requests)
    [group] = run.groups
    assert group.outcome == pb.GROUP_OUTCOME_ACCEPTED
    assert all(s.HasField("reward") and not s.reward_failure for s in group.samples)


async def test_batch_group_is_refused_where_it_would_be_ignored(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(
            h,
            [(prompt(0), 0, "1")],
            n_samples_per_prompt=2,
            params=SHORT,
            reward={"kind": "REWARD_KIND_MATH", "batch_group": True},
        )
    assert field_violation(err.value) == "reward.batch_group"


async def test_a_group_reward_scores_the_whole_group_in_one_call_and_keeps_the_detail(h: Harness) -> None:
    async with RewardServer() as rm:
        run = await run_step(
            h,
            [pb.PromptGroup(prompt=prompt(0), group_index=0, label="object")],
            n_samples_per_prompt=3,
            params=SHORT,
            reward={
                "kind": "REWARD_KIND_REMOTE",
                "url": rm.url,
                "scope": "REWARD_SCOPE_GROUP",
                "batch_group": True,
            },
        )
        assert len(rm.requests) == 1 and len(rm.requests[0]["responses"]) == 3
    [group] = run.groups
    assert group.outcome == pb.GROUP_OUTCOME_ACCEPTED
    for sample in group.samples:
        assert sample.reward == 0.5 and sample.reward_detail["why"] == "a detailed verdict"


@pytest.mark.parametrize(
    ("policy", "outcome"),
    [
        ("REWARD_FAILURE_POLICY_KEEP_UNSCORED", pb.GROUP_OUTCOME_ACCEPTED),
        ("REWARD_FAILURE_POLICY_DROP_GROUP", pb.GROUP_OUTCOME_FAILED),
    ],
)
async def test_a_reward_that_is_not_a_number_follows_the_callers_policy(
    h: Harness, policy: str, outcome: int
) -> None:
    async with RewardServer() as rm:
        groups = [
            pb.PromptGroup(prompt=prompt(0), group_index=0, label="text"),
            pb.PromptGroup(prompt=prompt(2), group_index=1, label="alternate"),
        ]
        run = await run_step(
            h,
            groups,
            n_samples_per_prompt=2,
            params=SHORT,
            target_groups=1,
            max_groups_in_flight=1,
            reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url, "on_failure": policy},
        )
    first = run.groups[0]
    assert first.group_index == 0 and first.outcome == outcome
    for sample in first.samples:
        assert not sample.HasField("reward") and "not a number" in sample.reward_failure
    assert run.summary is not None and run.summary.target_reached
    if outcome == pb.GROUP_OUTCOME_FAILED:
        assert "reward" in first.reason and run.summary.progress.dropped["reward_failed"] == 1
        assert [g.group_index for g in run.by_outcome(pb.GROUP_OUTCOME_ACCEPTED)] == [1]


async def test_the_blocking_client_runs_a_step_with_a_progress_bar(
    h: Harness, capsys: pytest.CaptureFixture[str]
) -> None:
    def blocking() -> list[pb.RolloutStepResponse]:
        with RolloutClient(h.target) as client:
            return list(
                client.rollout_step(
                    [(prompt(0), 0, "42"), (prompt(2), 1, "42")],
                    n_samples_per_prompt=2,
                    params=SHORT,
                    reward={"kind": "REWARD_KIND_EXACT_MATCH"},
                    progress_bar=True,
                    timeout=60,
                )
            )

    events = await asyncio.to_thread(blocking)
    groups = [e.group for e in events if e.WhichOneof("event") == "group"]
    assert sorted(g.group_index for g in groups) == [0, 1]
    assert all(s.HasField("reward") and s.reward == 0.0 for g in groups for s in g.samples)
    assert events[-1].WhichOneof("event") == "summary" and events[-1].summary.accepted == 2
    assert "rollout step" in capsys.readouterr().err


async def test_a_step_is_counted_and_logged_once() -> None:
    async with harness("sim", metrics_port=0) as h, RewardServer() as rm:
        closed: asyncio.Queue[CallRecord] = asyncio.Queue()
        h.server.calls.listeners.append(
            lambda record: closed.put_nowait(record) if record.method == "RolloutStep" else None
        )
        await h.client.resume("7")
        groups = [
            pb.PromptGroup(prompt=prompt(2 * i), group_index=i, label=lb)
            for i, lb in enumerate(["one", "alternate"])
        ]
        with capture_logs() as logs:
            run = await run_step(
                h,
                groups,
                n_samples_per_prompt=2,
                params=SHORT,
                reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url},
                filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
                step_id="counted",
            )
            record = await asyncio.wait_for(closed.get(), 10)
        assert record.step_groups == {"accepted": 1, "filtered": 1} and record.step_tokens == 4 * 6
        [line] = [e for e in logs if e.get("event") == "rollout_step_done"]
        assert line["step_id"] == "counted" and line["groups"] == {"accepted": 1, "filtered": 1}
        assert run.summary is not None and run.summary.accepted == 1
        url = f"http://127.0.0.1:{h.server.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            text = await response.text()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("rollout_grpc_step_groups_total", (("outcome", "accepted"),))] == 1
        assert samples[("rollout_grpc_step_groups_total", (("outcome", "filtered"),))] == 1
        assert samples[("rollout_grpc_step_version_lag_count", ())] == 2
        assert samples[("rollout_grpc_generation_tokens_total", ())] == 24


async def test_abort_by_group_ends_that_group_of_the_step_with_its_tokens(slow: Harness) -> None:
    run = StepRun()
    aborted = False
    async for event in slow.client.rollout_step(
        [(prompt(0), 0), (prompt(2), 1)],
        n_samples_per_prompt=2,
        params={**LONG_STEP, "max_new_tokens": 200},
        step_id="grp",
        timeout=120,
    ):
        if not aborted:
            aborted = True
            await slow.sims[0].wait_for_tokens(engine_id(slow.server, "grp/g1/s1"), 3)
            assert (await slow.client.abort(group_index=1)).aborted == 2
        kind = event.WhichOneof("event")
        if kind == "group":
            run.groups.append(event.group)
        elif kind == "summary":
            run.summary = event.summary
    outcomes = {g.group_index: g for g in run.groups}
    assert outcomes[1].outcome == pb.GROUP_OUTCOME_ABORTED and "aborted" in outcomes[1].reason
    for sample in outcomes[1].samples:
        assert sample.status == pb.SAMPLE_STATUS_ABORTED and 0 < sample.response_length < 200
        assert_consistent(sample)
    assert outcomes[0].outcome == pb.GROUP_OUTCOME_ACCEPTED, "the other group goes on"
    assert all(s.response_length == 200 for s in outcomes[0].samples)
    assert run.summary is not None and run.summary.accepted == 1 and not run.summary.target_reached


async def test_a_replica_that_shuts_down_mid_step_returns_the_groups_with_their_tokens(slow: Harness) -> None:
    run = StepRun()

    async def follow() -> None:
        async for event in slow.client.rollout_step(
            [(prompt(0), 0), (prompt(2), 1), (prompt(4), 2)],
            n_samples_per_prompt=2,
            params={**LONG_STEP, "max_new_tokens": 3000},
            max_groups_in_flight=2,
            step_id="bye",
            timeout=60,
        ):
            kind = event.WhichOneof("event")
            if kind == "group":
                run.groups.append(event.group)
            elif kind == "summary":
                run.summary = event.summary

    task = asyncio.create_task(follow())
    await slow.sims[0].wait_for_tokens(engine_id(slow.server, "bye/g1/s1"), 3)
    await slow.server.stop(grace_s=0)
    await asyncio.wait_for(task, 30)
    assert sorted(g.group_index for g in run.groups) == [0, 1]
    for group in run.groups:
        assert group.outcome == pb.GROUP_OUTCOME_ABORTED
        for sample in group.samples:
            assert sample.status == pb.SAMPLE_STATUS_ABORTED and sample.response_length >= 1
            assert_consistent(sample)
    assert run.summary is not None and "shutting down" in run.summary.reason
    assert list(run.summary.unstarted_group_indexes) == [2]


@pytest.mark.parametrize("trick", ["userinfo", "longer port"])
async def test_a_pinned_reward_prefix_is_no_string_prefix(trick: str) -> None:
    """`--reward-url http://127.0.0.1:1` pins the reward server at port 1: a URL that merely starts
    with that text reaches another server (the samples go to whoever runs it), and is refused
    before any request leaves the replica."""
    async with RewardServer() as rm:
        port = int(rm.url.split(":")[2].split("/")[0])
        pinned, url = {
            "userinfo": ("http://127.0.0.1:1", f"http://127.0.0.1:1@127.0.0.1:{port}/rm"),
            "longer port": (f"http://127.0.0.1:{str(port)[:-1]}", rm.url),
        }[trick]
        async with harness("sim", reward_urls=[pinned]) as h:
            error = await refused_remote_reward_step(h, url)
        assert field_violation(error) == "reward.url"
        assert rm.probes == 0 and not rm.requests, "the URL is refused before it is probed"


async def test_a_replica_can_pin_remote_rewards_to_its_own_reward_servers() -> None:
    async with harness("sim", reward_urls=["http://127.0.0.1:1/"]) as h, RewardServer() as rm:
        assert field_violation(await refused_remote_reward_step(h, rm.url)) == "reward.url"
        assert rm.probes == 0 and not rm.requests, "the URL is refused before it is probed"
