"""RolloutStep under faults (issue 22): the reward model dies mid-step, Abort(all) lands mid-step.

Every sample of the step must come back with its tokens: the step's leftovers (ABORTED), continued
by a second step, must end exactly as the uninterrupted greedy reference, so no token was lost or
duplicated between the abort and the continuation. Each fault adds a row to the fault table.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.server.app import RolloutServer
from tests.faults.support import PROMPT, Outcome, consume, greedy
from tests.harness import running_server, sim_engines
from tests.support.reward_server import RewardServer
from tests.support.service import engine_id

Record = Callable[[str, list[Outcome], list[int]], None]
TOKENS = 80
SIM = {"token_delay_s": 0.01, "eos_probability": 0.0}


@contextlib.asynccontextmanager
async def replica(
    engines: int = 1,
) -> AsyncIterator[tuple[Any, AsyncRolloutClient, list[int], RolloutServer]]:
    async with (
        sim_engines(engines, **SIM) as sims,
        running_server([s.url for s in sims], health_interval_s=60.0) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        out = await consume(client, "reference", TOKENS)
        assert out.final is not None and out.final.response_length == TOKENS
        yield sims, client, out.response, server


def nearly_done(reference: list[int], index: int, done: int) -> list[pb.Sample]:
    """Two ABORTED partial samples holding the first `done` reference tokens."""
    return [
        pb.Sample(
            tokens=[*PROMPT, *reference[:done]],
            index=index + i,
            response_length=done,
            loss_mask=[1] * done,
            rollout_log_probs=[-1.0] * done,
            status=pb.SAMPLE_STATUS_ABORTED,
        )
        for i in range(2)
    ]


async def step(client: AsyncRolloutClient, groups: list[Any], **kw: Any) -> list[pb.RolloutStepResponse]:
    return [
        e
        async for e in client.rollout_step(
            groups, n_samples_per_prompt=2, params=greedy(TOKENS), timeout=60, **kw
        )
    ]


async def finish(
    client: AsyncRolloutClient, events: list[pb.RolloutStepResponse], fault: str
) -> list[Outcome]:
    """Continue every ABORTED group of `events` in a second step; one Outcome per final sample,
    after checking each continuation extends the aborted sample's tokens."""
    groups = [e.group for e in events if e.WhichOneof("event") == "group"]
    aborted = [g for g in groups if g.outcome == pb.GROUP_OUTCOME_ABORTED]
    assert aborted, f"{fault}: the fault left no group in flight"
    before = {(g.group_index, s.index): list(s.tokens) for g in aborted for s in g.samples}
    again = [
        pb.PromptGroup(prompt=make_sample(PROMPT), group_index=g.group_index, partial=g.samples)
        for g in aborted
    ]
    continued = [e.group for e in await step(client, again) if e.WhichOneof("event") == "group"]
    finals = [s for g in groups if g.outcome != pb.GROUP_OUTCOME_ABORTED for s in g.samples]
    for group in continued:
        for sample in group.samples:
            old = before[(group.group_index, sample.index)]
            assert list(sample.tokens[: len(old)]) == old, "the continuation must extend the aborted sample"
            finals.append(sample)
    outcomes = []
    for i, sample in enumerate(finals):
        out = Outcome(f"{fault}-{i}", final=sample, finals=1)
        out.streamed = list(sample.tokens[len(PROMPT) :])
        outcomes.append(out)
    return outcomes


async def test_the_reward_server_dies_mid_step(record: Record) -> None:
    # Timeline (10 ms per token): group 9 needs 40 more tokens and is accepted at ~0.4 s, when the
    # reward server goes down and group 4 starts in its slot; groups 0-2 end at ~0.8 s, their
    # rewards fail (FAIL_GROUP stops the step) while group 4 is half-way: it must come back
    # ABORTED with its tokens, and its continuation must match the reference.
    async with replica() as (_, client, ref, _server), RewardServer() as rm:
        quick = pb.PromptGroup(
            prompt=make_sample(PROMPT),
            group_index=9,
            label="alternate",
            partial=nearly_done(ref, 0, TOKENS // 2),
        )
        fresh = [
            pb.PromptGroup(prompt=make_sample(PROMPT), group_index=i, label="alternate") for i in range(5)
        ]
        events: list[pb.RolloutStepResponse] = []
        async for event in client.rollout_step(
            [quick, *fresh[:3], fresh[4]],
            n_samples_per_prompt=2,
            params=greedy(TOKENS),
            max_groups_in_flight=4,
            reward={"kind": "REWARD_KIND_REMOTE", "url": rm.url, "max_retries": 0},
            timeout=60,
        ):
            events.append(event)
            if event.WhichOneof("event") == "group" and event.group.group_index == 9:
                await rm.stop()
        outcomes = await finish(client, events, "reward-down")
        record("RolloutStep: reward server down mid-step", outcomes, ref)
        assert len(outcomes) == 10
        assert any(
            e.group.outcome == pb.GROUP_OUTCOME_ABORTED for e in events if e.WhichOneof("event") == "group"
        )


async def test_abort_all_lands_mid_step(record: Record) -> None:
    async with replica() as (sims, client, ref, server):
        events: list[pb.RolloutStepResponse] = []
        async for event in client.rollout_step(
            [(make_sample(PROMPT), i) for i in range(3)],
            n_samples_per_prompt=2,
            params=greedy(TOKENS),
            step_id="faults",
            timeout=60,
        ):
            if not events:
                await sims[0].wait_for_tokens(engine_id(server, "faults/g2/s1"), 3)
                await client.abort(all=True)
            events.append(event)
        outcomes = await finish(client, events, "abort-all")
        record("RolloutStep: Abort(all) mid-step", outcomes, ref)
        assert len(outcomes) == 6


async def test_engines_drop_connections_mid_step(record: Record) -> None:
    async with replica(engines=2) as (sims, client, ref, _server):
        sims[0].faults.drop_connection = 4  # every call engine 0 serves breaks after a few tokens
        sims[0].faults.drop_after_tokens = 5
        events = await step(client, [(make_sample(PROMPT), i) for i in range(2)])
        groups = [e.group for e in events if e.WhichOneof("event") == "group"]
        outcomes = []
        for group in groups:
            assert group.outcome == pb.GROUP_OUTCOME_ACCEPTED, group.reason
            for sample in group.samples:
                out = Outcome(f"drop-{group.group_index}-{sample.index}", final=sample, finals=1)
                out.streamed = list(sample.tokens[len(PROMPT) :])
                outcomes.append(out)
        record("RolloutStep: engines drop connections mid-step", outcomes, ref)
        assert len(outcomes) == 4
        attempts = [len(s.engine_attempts) for g in groups for s in g.samples]
        assert all(n <= 2 for n in attempts) and any(n == 2 for n in attempts), attempts


async def test_a_rule_reward_that_never_ends_while_other_callers_stream(record: Record) -> None:
    """A MATH label whose comparison computes for minutes (`9^{9^{9^{9}}}`): its child process is
    killed at the time limit; the Generates streamed meanwhile lose nothing (before, the comparison
    held Python's lock and every RPC of the replica stopped)."""
    async with (
        sim_engines(1, **SIM) as sims,
        running_server([s.url for s in sims], health_interval_s=60.0, rule_reward_timeout_s=20.0) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        ref = (await consume(client, "reference", TOKENS)).response
        done = pb.Sample(
            tokens=[*PROMPT, *ref[:1]],
            response_length=1,
            loss_mask=[1],
            rollout_log_probs=[-1.0],
            response="\\boxed{5}",
            status=pb.SAMPLE_STATUS_COMPLETED,
        )
        group = pb.PromptGroup(
            prompt=make_sample(PROMPT), group_index=0, label="9^{9^{9^{9}}}", partial=[done]
        )
        results: list[pb.GroupResult] = []
        scoring = asyncio.Event()

        async def run_step() -> None:
            async for event in client.rollout_step(
                [group],
                n_samples_per_prompt=1,
                reward={"kind": "REWARD_KIND_MATH", "on_failure": "REWARD_FAILURE_POLICY_DROP_GROUP"},
                stream_samples=True,
                timeout=120,
            ):
                if event.WhichOneof("event") == "sample":
                    scoring.set()
                elif event.WhichOneof("event") == "group":
                    results.append(event.group)

        stepping = asyncio.create_task(run_step())
        await scoring.wait()
        outcomes = await asyncio.gather(*(consume(client, f"during-{i}", TOKENS) for i in range(4)))
        assert not results, "the streams ended while the reward was still being computed"
        record("RolloutStep: a rule reward computes past its time limit", list(outcomes), ref)
        await stepping
        [result] = results
        assert result.outcome == pb.GROUP_OUTCOME_FAILED
        assert "time limit of 20 s" in result.samples[0].reward_failure
