"""`make run`: a GRPO-style rollout with over-sampling and partial-rollout continuation.

It starts two simulated engines (vLLM, or with `--sim-sglang N` that many of them SGLang) and a
service replica in this process, then, through the Python client over real gRPC and HTTP:

1. generates `prompts x samples_per_prompt` samples (one session per group) and aborts everything
   once half of them have finished, as an over-sampling trainer does;
2. continues the ABORTED samples with their remaining budget (partial rollout);
3. prints a table of statuses, tokens and throughput, and checks the trainer contract.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from tqdm import tqdm

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.server.app import RolloutServer, ServerConfig
from rollout_grpc.sim import SimConfig, SimEngine
from rollout_grpc.sim.config import SGLangOptions

_STATUS = {v: k.removeprefix("SAMPLE_STATUS_") for k, v in pb.SampleStatus.items()}


def _prompt(group: int) -> list[int]:
    """A deterministic prompt of 24 ordinary token ids (not special tokens)."""
    return [100 + (group * 37 + i * 11) % 1500 for i in range(24)]


T = TypeVar("T")


def _completed(tasks: Iterable[Awaitable[T]], bar: tqdm[Any] | None) -> Iterable[Awaitable[T]]:
    """`asyncio.as_completed`, advancing the progress bar (if any) as each one finishes."""
    for next_done in asyncio.as_completed(tasks):
        yield next_done
        if bar is not None:
            bar.update(1)


def _check(sample: pb.Sample) -> bool:
    n = sample.response_length
    return len(sample.loss_mask) == n == len(sample.rollout_log_probs) and len(sample.tokens) > n


@dataclass(frozen=True, slots=True)
class Phase:
    """One row of the demo's table."""

    name: str
    samples: list[pb.Sample]
    #: Tokens generated in this phase (not those a continued sample brought from an earlier one).
    tokens: int
    seconds: float

    def row(self) -> str:
        counts = collections.Counter(_STATUS[s.status] for s in self.samples)
        statuses = ", ".join(f"{k.lower()} {v}" for k, v in sorted(counts.items()))
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"| {self.name:<22} | {len(self.samples):>7} | {statuses:<38} | {self.tokens:>7} | {rate:>9.0f} |"
        )


def phases(
    round1: list[pb.Sample], continued: list[pb.Sample], round1_s: float, round2_s: float
) -> list[Phase]:
    """The table's rows. A continued sample arrives with the tokens it had when it was aborted;
    phase 2 is credited only with the ones generated after that, so its tokens/s is a rate of
    that phase's own work, and the phases' tokens add up to the final row's."""
    before = {s.index: s.response_length for s in round1}
    final = {s.index: s for s in round1} | {s.index: s for s in continued}
    return [
        Phase("1: generate, abort-all", round1, sum(s.response_length for s in round1), round1_s),
        Phase(
            "2: continue aborted",
            continued,
            sum(s.response_length - before.get(s.index, 0) for s in continued),
            round2_s,
        ),
        Phase(
            "final", list(final.values()), sum(s.response_length for s in final.values()), round1_s + round2_s
        ),
    ]


def abort_summary(replica_aborted: int, round1: list[pb.Sample]) -> str:
    """The footer's line about the abort, counted from the samples as the table is.

    The replica's count (`AbortResponse.aborted`) includes generations whose engine finished them
    at the moment of the abort: they come back COMPLETED or TRUNCATED, not ABORTED
    (proto/rollout.proto).
    The footer printed that count, so it could say 14 where the table said 13."""
    ended = sum(1 for s in round1 if s.status == pb.SAMPLE_STATUS_ABORTED)
    line = f"abort-all ended {ended} in-flight generations as ABORTED"
    if replica_aborted != ended:
        late = replica_aborted - ended
        line += f" (the replica was ending {replica_aborted}; {late} finished at that moment"
        line += " with their own status)"
    return f"{line}; {ended} continued with their remaining budget."


async def run_demo(
    prompts: int, samples_per_prompt: int, max_new_tokens: int, progress: bool = False, sim_sglang: int = 0
) -> int:
    """Run the demo and print its table; returns the process exit code.

    `progress` shows a tqdm bar (on stderr) of finished samples in each phase; `sim_sglang` of the
    two engines (0 to 2) are simulated SGLang engines (a mixed fleet with 1).
    """
    if not 0 <= sim_sglang <= 2:
        raise ValueError(f"--sim-sglang must be 0, 1 or 2, got {sim_sglang}")
    kinds = ["sglang" if i < sim_sglang else "vllm" for i in range(2)]
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(
                SimEngine(
                    SimConfig(
                        token_delay_s=0.002,
                        seed=i,
                        logprobs_mode="processed_logprobs",
                        kind=kind,
                        # The demo sends seeds: SGLang honours them only in deterministic mode.
                        sglang=SGLangOptions(enable_deterministic_inference=True),
                    )
                )
            )
            for i, kind in enumerate(kinds)
        ]
        engine_kinds = {e.url: "sglang" for e, kind in zip(engines, kinds, strict=True) if kind == "sglang"}
        config = ServerConfig(
            engines=[e.url for e in engines], engine_kinds=engine_kinds, port=0, health_port=None
        )
        server = RolloutServer(config)
        await server.start()
        stack.push_async_callback(server.stop, 1.0)
        client = await stack.enter_async_context(AsyncRolloutClient(f"127.0.0.1:{server.port}"))
        params = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "seed": 7}
        samples = [
            make_sample(_prompt(g), index=g * samples_per_prompt + j, group_index=g, session_id=f"group-{g}")
            for g in range(prompts)
            for j in range(samples_per_prompt)
        ]

        started = time.perf_counter()
        tasks = [asyncio.create_task(client.generate(s, {**params, "seed": 7 + s.index})) for s in samples]
        target = len(tasks) // 2
        bar = tqdm(total=len(tasks), desc="phase 1", unit="sample", leave=False) if progress else None
        for done, next_done in enumerate(_completed(tasks, bar), start=1):
            await next_done
            if done == target:
                break
        aborted = await client.abort(all=True)
        round1 = list(await asyncio.gather(*tasks))
        round1_s = time.perf_counter() - started
        if bar is not None:
            bar.close()

        started = time.perf_counter()
        pending = [s for s in round1 if s.status == pb.SAMPLE_STATUS_ABORTED]
        bar = tqdm(total=len(pending), desc="phase 2", unit="sample", leave=False) if progress else None
        continuing = [asyncio.create_task(client.generate(s, params)) for s in pending]
        for next_done in _completed(continuing, bar):
            await next_done
        continued: list[pb.Sample] = [t.result() for t in continuing]
        round2_s = time.perf_counter() - started
        if bar is not None:
            bar.close()
        final = {s.index: s for s in round1}
        final.update({s.index: s for s in continued})

    fleet = " + ".join(
        f"{kinds.count(k)} simulated {name}"
        for k, name in (("vllm", "vLLM"), ("sglang", "SGLang"))
        if k in kinds
    )
    print(f"\nrollout-grpc demo: {fleet} engine(s), 1 replica, Python client over gRPC\n")
    print(f"| {'phase':<22} | {'samples':>7} | {'statuses':<38} | {'tokens':>7} | {'tokens/s':>9} |")
    print(f"|{'-' * 24}|{'-' * 9}|{'-' * 40}|{'-' * 9}|{'-' * 11}|")
    for phase in phases(round1, continued, round1_s, round2_s):
        print(phase.row())
    ok = all(_check(s) for s in final.values())
    exact = all(
        s.response_length == max_new_tokens for s in final.values() if s.status == pb.SAMPLE_STATUS_TRUNCATED
    )
    print(f"\n{abort_summary(aborted.aborted, round1)}")
    print(
        f"trainer contract (len(loss_mask) == response_length == len(logprobs)): {'ok' if ok else 'BROKEN'}"
    )
    verdict = "ok" if exact else "BROKEN"
    print(f"truncated samples have exactly max_new_tokens={max_new_tokens} tokens: {verdict}")
    still_pending = [
        s for s in final.values() if s.status in (pb.SAMPLE_STATUS_ABORTED, pb.SAMPLE_STATUS_FAILED)
    ]
    return 0 if ok and exact and not still_pending else 1
