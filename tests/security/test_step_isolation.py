"""Abort{mine} and the RolloutStep buffer are scoped to the caller, with authentication on."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.harness import running_server, sim_engines
from tests.security.credentials import PEER, TRAINER_A, TRAINER_B
from tests.support.service import (
    LONG,
    PROMPT,
    SLOW_SIM,
    assert_lossless,
    field_violation,
    start_stream,
    started,
)

SHORT = {**LONG, "max_new_tokens": 300}


async def test_abort_mine_ends_only_the_callers_generations_and_buffers_are_per_caller(
    tokens_file: Path,
) -> None:
    async with (
        sim_engines(1, **SLOW_SIM) as sims,
        running_server([s.url for s in sims], auth_tokens_file=str(tokens_file)) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_A) as a,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_B) as b,
    ):
        a1, a2 = start_stream(a, "a-1"), start_stream(a, "a-2")
        other = start_stream(b, "b-1", SHORT)
        await started(a1, a2, other)
        assert (await a.abort(mine=True)).aborted == 2
        for stream in (a1, a2):
            sample = await stream.task
            assert sample.status == pb.SAMPLE_STATUS_ABORTED
            assert_lossless(stream, sample)
        finished = await other.task
        assert finished.status == pb.SAMPLE_STATUS_TRUNCATED and finished.response_length == 300

        # A's leftovers go to A's buffer: B's step cannot continue them.
        done = 295
        quick = pb.PromptGroup(
            prompt=make_sample(PROMPT),
            group_index=0,
            partial=[
                pb.Sample(
                    tokens=[*PROMPT, *([5] * done)],
                    response_length=done,
                    loss_mask=[1] * done,
                    rollout_log_probs=[-1.0] * done,
                    status=pb.SAMPLE_STATUS_ABORTED,
                )
            ],
        )
        events = [
            e
            async for e in a.rollout_step(
                [quick, (make_sample(PROMPT), 1)],
                n_samples_per_prompt=1,
                params=SHORT,
                target_groups=1,
                max_groups_in_flight=2,
                over_sampling="keep_in_flight",  # both start at once
                leftovers="buffer",
                timeout=60,
            )
        ]
        assert events[-1].summary.buffered == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in b.rollout_step([], n_samples_per_prompt=1, continue_buffered=True, timeout=60):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # B has nothing buffered
        mine = [
            e async for e in a.rollout_step([], n_samples_per_prompt=1, params=SHORT, continue_buffered=True)
        ]
        [group] = [e.group for e in mine if e.WhichOneof("event") == "group"]
        assert group.group_index == 1 and group.samples[0].response_length == 300


async def test_abort_mine_reaches_the_callers_generations_on_the_peers(
    tokens_file: Path, tmp_path: Path
) -> None:
    peer_token = tmp_path / "peer-token"
    peer_token.write_text(PEER + "\n")
    secured: dict[str, object] = {"auth_tokens_file": str(tokens_file), "peer_token_file": str(peer_token)}
    async with sim_engines(1, **SLOW_SIM) as sims:
        urls = [s.url for s in sims]
        async with (
            running_server(urls, **secured) as r1,
            running_server(urls, peers=[f"127.0.0.1:{r1.port}"], **secured) as r2,
            AsyncRolloutClient(f"127.0.0.1:{r1.port}", token=TRAINER_A) as a_on_r1,
            AsyncRolloutClient(f"127.0.0.1:{r2.port}", token=TRAINER_A) as a_on_r2,
            AsyncRolloutClient(f"127.0.0.1:{r1.port}", token=TRAINER_B) as b_on_r1,
        ):
            far = start_stream(a_on_r1, "a-far")
            other = start_stream(b_on_r1, "b-near", SHORT)
            await started(far, other)
            assert (await a_on_r2.abort(mine=True)).aborted == 1
            sample = await far.task
            assert sample.status == pb.SAMPLE_STATUS_ABORTED
            assert_lossless(far, sample)
            finished = await other.task
            assert finished.status == pb.SAMPLE_STATUS_TRUNCATED and finished.response_length == 300


async def test_a_step_larger_than_the_callers_share_is_refused_up_front(tokens_file: Path) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims], auth_tokens_file=str(tokens_file), max_in_flight_per_caller=4
        ) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_A) as a,
    ):
        groups = [(make_sample(PROMPT), i) for i in range(3)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in a.rollout_step(groups, n_samples_per_prompt=4, max_groups_in_flight=2, timeout=30):
                pass
        assert field_violation(err.value) == "max_groups_in_flight"
        fits = [
            e
            async for e in a.rollout_step(
                groups, n_samples_per_prompt=4, max_groups_in_flight=1, params={"max_new_tokens": 4}
            )
        ]
        assert fits[-1].summary.accepted == 3
        assert sims[0].stats.generate_requests == 12


async def test_a_step_is_held_to_the_request_bounds_of_generate() -> None:
    async with (
        sim_engines(1) as sims,
        running_server([s.url for s in sims]) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}") as client,
    ):
        too_many = {"max_new_tokens": 4, "stop": [f"s{i}" for i in range(65)]}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.rollout_step(
                [(make_sample(PROMPT), 0)], n_samples_per_prompt=1, params=too_many
            ):
                pass
        assert field_violation(err.value) == "sampling_params.stop"
        big = make_sample(PROMPT, metadata={"blob": "x" * (1100 << 10)})
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.rollout_step([(big, 0)], n_samples_per_prompt=1):
                pass
        assert field_violation(err.value) == "groups[0].prompt.metadata"
        assert sims[0].stats.generate_requests == 0
