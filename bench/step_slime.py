"""RolloutStep's default over-sampling vs slime's own loop written on the client over Generate.

slime's `generate_rollout_async` (THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515,
`slime/rollout/sglang_rollout.py`), written here over this service's `Generate`: while fewer than
the target groups are kept, submit a batch of `over_sampling_batch_size` (= the target, slime's
default) prompt groups whenever (submitted - dropped) < target; each sample is generated and then
scored by one reward POST (slime's `generate_and_rm`); a group whose rewards all agree is dropped
(DAPO's nonzero-std filter); at the target the groups still generating are aborted (one Abort of
the caller's generations, as slime aborts its engines until idle) and drained. The same step
as one `RolloutStep` with the default policy (`SLIME_BATCHES`).

Both paths use the same prompt groups (distinct prompts), the same seeds (sample i of a group gets
seed + i) and the same reward server, so a group's filter outcome is the same on both paths; the
groups generated differ only by the order in which groups end. Engines: two simulated vLLM engines
(own processes, 10 ms per token by default), the service one `rollout-grpc serve` process. The
paths alternate (ABBA). Reported per repetition: wall time, groups started, accepted.
`python -m bench.step_slime [--targets 32 128] [--reps 2]` writes a section of
`docs/benchmarks.step.md` (unless `--no-write`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs
from bench.step import DOCS, write_section
from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.support.reward_server import RewardServer

PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301, 835, 38, 2, 206, 1, 72, 345, 80, 1653, 206]
PATHS = ("slime loop over Generate", "RolloutStep")
#: Reward requests at once on both paths (slime's remote_rm connection limit).
REWARD_CONNECTIONS = 64


@dataclass(frozen=True, slots=True)
class Workload:
    target: int
    n: int
    tokens: int
    token_delay_ms: float

    @property
    def supply(self) -> int:
        """Prompt groups on offer: enough for three over-sampling batches past the target."""
        return 4 * self.target


@dataclass(slots=True)
class Result:
    wall_s: float
    started: int
    accepted: int
    #: How the step ended when it fell short of the target (its summary's reason).
    note: str = ""


def groups(w: Workload) -> list[tuple[list[int], str]]:
    """(prompt ids, label) per group: a seeded third score 1.0 on every sample (always dropped),
    the rest the parity of the response (kept unless all n samples agree)."""
    rng = random.Random(38)
    return [([*PROMPT, 100 + g], "one" if rng.random() < 1 / 3 else "parity") for g in range(w.supply)]


def params(w: Workload) -> dict[str, Any]:
    return {"temperature": 1.0, "max_new_tokens": w.tokens, "ignore_eos": True, "seed": 7}


async def slime_loop(client: AsyncRolloutClient, rm_url: str, w: Workload, tag: str) -> Result:
    """slime's loop over Generate (see the module docstring)."""
    supply = groups(w)
    started = time.perf_counter()
    # slime's remote_rm shares one session of at most 64 connections (rm_hub `_get_shared_session`).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=REWARD_CONNECTIONS)) as http:

        async def sample(g: int, i: int, label: str) -> float | None:
            prompt, _ = supply[g]
            s = make_sample(prompt, index=g * w.n + i, group_index=g, session_id=f"{tag}-g{g}")
            final = await client.generate(s, {**params(w), "seed": 7 + i}, {"final_only": True})
            if final.status == pb.SAMPLE_STATUS_ABORTED:
                return None
            payload = {"prompt": "", "response": final.response, "label": label}
            async with http.post(rm_url, json=payload) as response:
                return float(await response.json())

        async def group(g: int) -> list[float | None]:
            label = supply[g][1]
            return list(await asyncio.gather(*(sample(g, i, label) for i in range(w.n))))

        pending: dict[asyncio.Task[list[float | None]], int] = {}
        submitted = remaining = accepted = aborted = 0
        while accepted < w.target:
            while remaining < w.target and submitted < len(supply):
                batch = range(submitted, min(submitted + w.target, len(supply)))
                for g in batch:
                    pending[asyncio.create_task(group(g))] = g
                submitted += len(batch)
                remaining += len(batch)
            if not pending:
                break  # every prompt group used: the note says how far it got
            done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.pop(task)
                rewards = task.result()
                aborted += any(r is None for r in rewards)
                if any(r is None for r in rewards) or statistics.pstdev(r or 0.0 for r in rewards) <= 1e-6:
                    remaining -= 1
                    continue
                accepted += 1
        if pending:  # slime aborts every engine until idle: one Abort of this caller's generations
            await client.abort(mine=True)
        await asyncio.gather(*pending, return_exceptions=True)
    note = f"{aborted} groups came back ABORTED" if aborted else ""
    if accepted < w.target:
        note = f"the prompt groups ran out; {note}"
    return Result(time.perf_counter() - started, submitted, min(accepted, w.target), note)


async def rollout_step(client: AsyncRolloutClient, rm_url: str, w: Workload, tag: str) -> Result:
    """The same step as one RolloutStep (default policy: slime's rule)."""
    supply = groups(w)
    messages = [
        pb.PromptGroup(prompt=make_sample(prompt, index=g * w.n), group_index=g, label=label)
        for g, (prompt, label) in enumerate(supply)
    ]
    started = time.perf_counter()
    summary: pb.StepSummary | None = None
    async for event in client.rollout_step(
        messages,
        n_samples_per_prompt=w.n,
        step_id=tag,
        target_groups=w.target,
        params=params(w),
        reward={"kind": "REWARD_KIND_REMOTE", "url": rm_url, "max_concurrency": REWARD_CONNECTIONS},
        filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
        timeout=1200,
    ):
        if event.WhichOneof("event") == "summary":
            summary = event.summary
    assert summary is not None
    return Result(
        time.perf_counter() - started,
        len(supply) - len(summary.unstarted_group_indexes),
        summary.accepted,
        "" if summary.target_reached else f"{summary.reason} (dropped {dict(summary.progress.dropped)})",
    )


async def measure(target: str, rm_url: str, w: Workload, reps: int) -> list[tuple[str, Result]]:
    order = [PATHS[i % 2] if (i // 2) % 2 == 0 else PATHS[1 - i % 2] for i in range(2 * reps)]
    results = []
    async with AsyncRolloutClient(target) as client:
        for i, path in enumerate(order):
            run = slime_loop if path == PATHS[0] else rollout_step
            results.append((path, await run(client, rm_url, w, f"s{w.target}-{i}")))
    return results


async def main_async(targets: list[int], n: int, tokens: int, delay_ms: float, reps: int) -> str:
    rows = [
        "| target G | n | path | rep | wall s | groups started | accepted | started vs loop "
        "| wall vs loop | note |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-step-slime-") as tmp, procs.Processes(Path(tmp)) as group:
        engines = [procs.start_sim(group, f"sim-{i}", delay_ms, i).url for i in range(2)]
        service = procs.start_service(group, "service", engines)
        async with RewardServer() as rm:
            for target in targets:
                w = Workload(target, n, tokens, delay_ms)
                results = await measure(service.target, rm.url, w, reps)
                loops = [r for p, r in results if p == PATHS[0]]
                for rep, (path, r) in enumerate(results):
                    base = loops[min(rep // 2, len(loops) - 1)]
                    rows.append(
                        f"| {target} | {n} | {path} | {rep // 2 + 1} | {r.wall_s:.1f} | {r.started} | "
                        f"{r.accepted} | {r.started / base.started:.2f}x | "
                        f"{r.wall_s / base.wall_s:.2f}x | {r.note} |"
                    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--targets", type=int, nargs="+", default=[32, 128], help="target groups G")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="simulated ms per token")
    parser.add_argument("--reps", type=int, default=1, help="ABBA repetitions (each runs both paths)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    table = asyncio.run(main_async(args.targets, args.n, args.tokens, args.delay_ms, args.reps))
    text = (
        "## RolloutStep (default over-sampling) vs slime's loop over Generate\n\n"
        f"`python -m bench.step_slime` ({args.tokens} tokens per sample, {args.delay_ms:g} ms per token, "
        "two simulated engines, one service process, a remote reward and the nonzero-std filter; the\n"
        "hand loop is slime's `generate_rollout_async` rule written on the client, the step uses its\n"
        "default `SLIME_BATCHES` policy; same prompts, seeds and reward server; a shared 2-core machine,\n"
        "so wall times are indicative). 'vs loop' compares with the slime loop of the same repetition.\n"
        "A note 'groups came back ABORTED' marks a run whose first Generates were ended by the previous\n"
        "run's Abort of the caller's generations: that run, and its pair, are not comparable.\n\n"
        + table
        + "\n"
    )
    if not args.no_write:
        write_section(DOCS / "benchmarks.step.md", "step-slime", text)
    print(text)


if __name__ == "__main__":
    main()
