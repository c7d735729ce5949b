"""Attacks on a replica's memory and event loop through RolloutStep (hardening round 3, items 2, 3, 6).

| attack | expected |
| --- | --- |
| 100,000 groups with n_samples_per_prompt 0 | INVALID_ARGUMENT `n_samples_per_prompt`, nothing converted |
| 100,000 groups asking a target of 100,001 | INVALID_ARGUMENT `target_groups`, nothing converted |
| 100,001 groups | INVALID_ARGUMENT `groups` |
| a 1M-token prompt with n = 64 | INVALID_ARGUMENT `groups[0].prompt.tokens` naming max_model_len |
| a partial sample over max_model_len | INVALID_ARGUMENT `groups[0].partial[0].tokens` |
| a prompt text over max_prompt_chars | INVALID_ARGUMENT `groups[0].prompt.prompt` |
| leftovers over the per-caller buffer bytes | handed back ABORTED with every token, naming the cap |
| a caller leaving with more in flight than its buffer holds | its next step's summary lists the lost groups |
| the two memory attacks on a worker subprocess | its RSS stays under docs/operations.md's bound |
| 64 samples over an accepted 200k-token prompt | the samples share the prompt: a worker grows < 230 MiB |
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.client.step import DEFAULT_BUFFER_NAME
from rollout_grpc.server.front.grpc import convert
from tests.harness import Harness, harness
from tests.support.partials import aborted_partials
from tests.support.processes import Processes, read_port_file, replica_command, start_engine
from tests.support.service import PROMPT, engine_id, field_violation
from tests.support.steps import run_step

#: The store key of this test process's anonymous buffer (the client names it by default).
ANON_BUFFER = f"anonymous#{DEFAULT_BUFFER_NAME}"

#: The simulator's max_model_len.
SIM_CONTEXT = 4096


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with harness("sim") as running:
        yield running


@contextlib.contextmanager
def conversions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the conversions of step requests to domain values (none may happen on a refusal)."""
    calls: list[int] = []
    real = convert.step_spec_from_pb

    def counted(msg: pb.RolloutStepRequest, defaults: Any) -> Any:
        calls.append(len(msg.groups))
        return real(msg, defaults)

    monkeypatch.setattr(convert, "step_spec_from_pb", counted)
    yield calls


async def _refused(h: Harness, groups: list[Any], **kw: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run_step(h, groups, **kw)
    return err.value


def many_groups(count: int) -> list[pb.PromptGroup]:
    sample = make_sample(PROMPT)
    return [pb.PromptGroup(prompt=sample, group_index=i) for i in range(count)]


@pytest.mark.parametrize(
    ("count", "kw", "field"),
    [
        (100_000, {"n_samples_per_prompt": 0}, "n_samples_per_prompt"),
        (100_000, {"n_samples_per_prompt": 1, "target_groups": 100_001}, "target_groups"),
        (100_001, {"n_samples_per_prompt": 1}, "groups"),
    ],
)
async def test_a_huge_step_is_refused_on_its_counts_before_it_is_converted(
    h: Harness, monkeypatch: pytest.MonkeyPatch, count: int, kw: dict[str, Any], field: str
) -> None:
    with conversions(monkeypatch) as calls:
        err = await _refused(h, many_groups(count), timeout=120, **kw)
    assert field_violation(err) == field
    assert calls == []  # refused on the wire message (old code: converted 100,000 groups first)


async def test_a_1m_token_prompt_with_n_64_is_refused_before_it_is_copied(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    huge = make_sample([1000 + i % 30000 for i in range(1_000_000)])
    with conversions(monkeypatch) as calls:
        err = await _refused(h, [(huge, 0)], n_samples_per_prompt=64, timeout=120)
    assert field_violation(err) == "groups[0].prompt.tokens"
    assert f"max_model_len={SIM_CONTEXT}" in (err.details() or "")
    assert calls == []
    # A prompt that leaves room to generate is taken.
    fits = make_sample((PROMPT * SIM_CONTEXT)[: SIM_CONTEXT - 8])
    run = await run_step(
        h, [(fits, 0)], n_samples_per_prompt=2, params={"max_new_tokens": 4, "ignore_eos": True}
    )
    assert [g.outcome for g in run.groups] == [pb.GROUP_OUTCOME_ACCEPTED]


async def test_a_partial_over_max_model_len_and_a_huge_prompt_text_are_refused(h: Harness) -> None:
    over = aborted_partials(PROMPT, 0, 1, SIM_CONTEXT)
    group = pb.PromptGroup(prompt=make_sample(PROMPT), group_index=0, partial=over)
    err = await _refused(h, [group], n_samples_per_prompt=1)
    assert field_violation(err) == "groups[0].partial[0].tokens"

    text = pb.Sample(prompt="x" * ((4 << 20) + 1))
    err = await _refused(h, [pb.PromptGroup(prompt=text, group_index=0)], n_samples_per_prompt=1)
    assert field_violation(err) == "groups[0].prompt.prompt" and "max_prompt_chars" in (err.details() or "")


# ----------------------------------------------------------------------------- the buffer's bytes

#: A prompt of 4000 tokens: a buffered group of two samples is estimated at ~0.5 MiB.
BIG_PROMPT = (PROMPT * 200)[:4000]
SLOW = {"token_delay_s": 0.02}
STEP_PARAMS = {"temperature": 1.0, "max_new_tokens": 90, "ignore_eos": True}


async def test_leftovers_over_the_callers_buffer_bytes_are_handed_back_with_their_tokens() -> None:
    async with harness("sim", sim_config=SLOW, step_buffer_mb_per_caller=1) as h:
        quick = pb.PromptGroup(
            prompt=make_sample(PROMPT), group_index=0, partial=aborted_partials(PROMPT, 0, 2, 85)
        )
        run = await run_step(
            h,
            [quick, (make_sample(BIG_PROMPT), 1), (make_sample(BIG_PROMPT), 2)],
            n_samples_per_prompt=2,
            params=STEP_PARAMS,
            target_groups=1,
            max_groups_in_flight=3,
            over_sampling="keep_in_flight",  # all three start at once, so two are left over
            leftovers="buffer",
        )
        assert [g.group_index for g in run.by_outcome(pb.GROUP_OUTCOME_ACCEPTED)] == [0]
        assert len(run.by_outcome(pb.GROUP_OUTCOME_BUFFERED)) == 1
        [back] = run.by_outcome(pb.GROUP_OUTCOME_ABORTED)
        assert "--step-buffer-mb-per-caller" in back.reason and "returned instead" in back.reason
        assert len(back.samples) == 2
        for sample in back.samples:
            assert list(sample.tokens[: len(BIG_PROMPT)]) == BIG_PROMPT
            assert len(sample.tokens) == len(BIG_PROMPT) + sample.response_length
        assert run.summary is not None and run.summary.buffered == 1
        steps = h.server.steps
        assert steps is not None and 0 < await steps.buffers.bytes_of(ANON_BUFFER) <= 1 << 20


async def test_a_caller_that_leaves_over_its_buffer_bytes_is_told_which_groups_were_lost() -> None:
    async with harness("sim", sim_config=SLOW, step_buffer_mb_per_caller=1) as h:
        stream = h.client.rollout_step(
            [(make_sample(BIG_PROMPT), 0), (make_sample(BIG_PROMPT), 1)],
            n_samples_per_prompt=2,
            params=STEP_PARAMS,
            step_id="gone",
            timeout=120,
        )
        await stream.__anext__()
        for group in (0, 1):
            await h.sims[0].wait_for_tokens(engine_id(h.server, f"gone/g{group}/s1"), 2)
        await stream.aclose()  # the trainer goes away: both groups are aborted into its buffer
        core = h.sims[0].core
        await core.wait_until(lambda: not core.running)  # the replica aborted the step's samples
        steps = h.server.steps
        assert steps is not None
        await steps.drained()
        assert await steps.buffers.count(ANON_BUFFER) == 1
        resumed = await run_step(h, [], n_samples_per_prompt=2, params=STEP_PARAMS, continue_buffered=True)
        [kept] = resumed.groups
        assert resumed.summary is not None
        assert list(resumed.summary.lost_group_indexes) == [1 - kept.group_index]
        again = await run_step(h, [(make_sample(PROMPT), 5)], n_samples_per_prompt=1, params=STEP_PARAMS)
        assert again.summary is not None and list(again.summary.lost_group_indexes) == []  # told once


# ----------------------------------------------------------------------------- a worker's RSS

#: docs/operations.md "Memory bounds": what one replica process may hold beyond its idle size
#: under these attacks with the default caps.
ATTACK_RSS_BOUND_MB = 1024


def _peak_rss_mb(pid: int) -> float:
    """The peak resident set of process `pid` (VmHWM: what a memory limit would have seen)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _workers(supervisor: int) -> list[int]:
    """The worker processes of a `serve --workers N` supervisor (its children)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return [int(c) for c in children]


@contextlib.asynccontextmanager
async def replica_process(
    workdir: Path, *flags: str, engines: tuple[str, ...] = ("--sim", "1")
) -> AsyncIterator[tuple[int, str]]:
    """The `rollout-grpc serve --sim 1` console script (or with other `engines` flags) in a
    subprocess: a real replica process, measured through /proc (never the test process)."""
    port_file = workdir / "ports.json"
    with Processes(workdir) as procs:
        proc = procs.start(
            "replica",
            [*replica_command(), "serve", *engines, "--port", "0", "--port-file", str(port_file), *flags],
        )
        ports = json.loads(await asyncio.to_thread(read_port_file, port_file, proc))
        yield proc.pid, f"127.0.0.1:{ports['grpc']}"


async def test_a_workers_rss_stays_under_the_documented_bound_under_the_memory_attacks(
    tmp_path: Path,
) -> None:
    async with (
        replica_process(tmp_path, "--workers", "2", "--step-buffer-mb-per-caller", "256") as (pid, target),
        AsyncRolloutClient(target, retry=None) as client,
    ):
        await client.server_info()
        workers = _workers(pid)
        assert len(workers) == 2
        idle = max(_peak_rss_mb(w) for w in workers)
        # The 1M-token prompt with n = 64, five times.
        huge = make_sample([1000 + i % 30000 for i in range(1_000_000)])
        for _ in range(5):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in client.rollout_step([(huge, 0)], n_samples_per_prompt=64, timeout=120):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        print(f"after 1M x 64: {max(_peak_rss_mb(w) for w in workers):.0f} MiB")
        # The buffer attack: partial groups of 64 long samples, continued into the buffer by a
        # step whose target is reached by its first group (the rest are leftovers).
        partials = aborted_partials(PROMPT, 0, 64, 3000)
        for round_ in range(8):
            groups = [
                pb.PromptGroup(prompt=make_sample(PROMPT), group_index=round_ * 100 + i, partial=partials)
                for i in range(12)
            ]
            async for _ in client.rollout_step(
                groups,
                n_samples_per_prompt=64,
                params={"max_new_tokens": 3001, "ignore_eos": True},
                target_groups=1,
                max_groups_in_flight=8,
                leftovers="buffer",
                timeout=300,
            ):
                pass
        peak = max(_peak_rss_mb(w) for w in workers)
        print(f"worker RSS: idle {idle:.0f} MiB, peak {peak:.0f} MiB")
    assert peak - idle < ATTACK_RSS_BOUND_MB, f"idle {idle:.0f} MiB, peak {peak:.0f} MiB"


# ----------------------------------------------------------------------------- a shared prompt

#: The long prompt of the sharing test, and the simulator's context that admits it.
LONG_PROMPT = 200_000
#: What a worker may grow by for one accepted 64-sample group over that prompt (one token each).
#: The wire carries every sample's prompt (`Sample.tokens` is prompt then response), so the group's
#: answer holds 64 prompts (~50 MB as protobuf ints, ~26 MB serialized) and each engine request
#: one JSON copy while it is sent; measured 184 MiB with the prompt shared by the samples, 277 MiB
#: when each sample held its own list (8 bytes a token: 64 x 1.6 MB more).
SHARED_PROMPT_RSS_BOUND_MB = 230


async def test_the_samples_of_a_group_share_one_prompt_so_64_cost_little_more_than_one(
    tmp_path: Path,
) -> None:
    """Hardening round 3, item 2: "never copy a prompt n times". An accepted group of 64 over a
    200k-token prompt, one token each, on a worker subprocess measured through /proc."""
    with Processes(tmp_path) as procs:
        engine = start_engine(
            procs,
            "engine",
            "--max-model-len",
            str(LONG_PROMPT + 16),
            "--eos-probability",
            "0",
            token_delay_ms=0,
        )
        async with (
            replica_process(tmp_path, engines=("--engine", f"http://127.0.0.1:{engine.port}")) as (
                pid,
                target,
            ),
            AsyncRolloutClient(target, retry=None) as client,
        ):
            await client.server_info()
            workers = _workers(pid)
            # A small group first, so that what every step allocates once (code paths, caches) is
            # in the idle figure.
            async for _ in client.rollout_step(
                [(make_sample(PROMPT), 0)], n_samples_per_prompt=2, params={"max_new_tokens": 1}, timeout=120
            ):
                pass
            idle = {w: _peak_rss_mb(w) for w in workers}
            prompt = make_sample([1000 + i % 1000 for i in range(LONG_PROMPT)])
            samples = 0
            async for response in client.rollout_step(
                [(prompt, 1)], n_samples_per_prompt=64, params={"max_new_tokens": 1}, timeout=300
            ):
                samples += len(response.group.samples)
            growth = max(_peak_rss_mb(w) - idle[w] for w in workers)
    print(
        f"worker RSS growth for 64 x {LONG_PROMPT} tokens: {growth:.0f} MiB (idle {max(idle.values()):.0f})"
    )
    assert samples == 64
    assert growth < SHARED_PROMPT_RSS_BOUND_MB, f"a worker grew by {growth:.0f} MiB"
