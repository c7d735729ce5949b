"""RolloutStep vs the same rollout step written by hand over Generate, same engines, one run.

The workload is one slime-style step: `GROUPS` prompt groups of `N` samples, a remote reward
model (an aiohttp app in this process speaking slime's remote_rm shape), DAPO's nonzero-std filter,
over-sampling (`IN_FLIGHT` groups generating at once) until `TARGET` groups are accepted, then the
groups still generating are aborted. The two paths:

* `hand loop` — what a trainer writes today: per group, `N` concurrent `Generate` calls
  (final_only, one session id), one reward POST per sample from the trainer, the filter, a count,
  and `Abort(session_id)` for every group still in flight at the target;
* `RolloutStep` — one call; the replica does the same.

Engines are simulated vLLM engines in their own processes (`python -m rollout_grpc.sim`), the
service one `rollout-grpc serve` process. The paths alternate (ABBA); the better repetition of each
is kept. Reported: wall time of the step, accepted groups per second, RPCs the trainer made, and CPU
time per generated sample of the service process and of this (trainer) process.
`python -m bench.step [--quick]` writes `docs/benchmarks.step.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs
from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.support.reward_server import RewardServer

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301, 835, 38, 2, 206, 1, 72, 345, 80, 1653, 206]
PATHS = ("hand loop", "RolloutStep")


@dataclass(frozen=True, slots=True)
class Workload:
    token_delay_ms: float
    groups: int
    n: int
    target: int
    in_flight: int
    tokens: int

    @property
    def key(self) -> str:
        return (
            f"delay {self.token_delay_ms:g} ms, {self.groups} groups x {self.n}, target {self.target}, "
            f"{self.in_flight} in flight, {self.tokens} tokens"
        )


def write_section(path: Path, name: str, text: str) -> None:
    """Replace the part of `path` between `<!-- begin NAME -->` and `<!-- end NAME -->` with `text`
    (appended when absent): bench.step and bench.step_n write one file, each its own section."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old + ("\n" if old and not old.endswith("\n\n") else "") + block
    path.write_text(new)


def plan(quick: bool) -> list[Workload]:
    if quick:
        return [Workload(0, 16, 4, 8, 12, 64)]
    return [Workload(0, 64, 4, 32, 48, 128), Workload(10, 64, 4, 32, 48, 128)]


def labels(count: int) -> list[str]:
    """One group in three scores the same on every sample (the filter drops it)."""
    return ["one" if i % 3 == 0 else "parity" for i in range(count)]


def params(w: Workload) -> dict[str, Any]:
    return {"temperature": 1.0, "max_new_tokens": w.tokens, "ignore_eos": True, "seed": 7}


async def hand_loop(client: AsyncRolloutClient, rm_url: str, w: Workload, tag: str) -> tuple[int, int, int]:
    """The step over Generate; (accepted groups, RPCs made, samples generated)."""
    rpcs = 0
    accepted = 0
    samples_done = 0
    done = asyncio.Event()
    slots = asyncio.Semaphore(w.in_flight)
    running: set[str] = set()

    async with aiohttp.ClientSession() as http:

        async def group(g: int, label: str) -> None:
            nonlocal rpcs, accepted, samples_done
            async with slots:
                if done.is_set():
                    return
                session = f"{tag}-g{g}"
                running.add(session)
                samples = [
                    make_sample(PROMPT, index=g * w.n + i, group_index=g, session_id=session)
                    for i in range(w.n)
                ]
                rpcs += w.n
                finals = await asyncio.gather(
                    *(
                        client.generate(s, {**params(w), "seed": 7 + i}, {"final_only": True})
                        for i, s in enumerate(samples)
                    )
                )
                running.discard(session)
                samples_done += len(finals)
                if done.is_set() or any(f.status == pb.SAMPLE_STATUS_ABORTED for f in finals):
                    return

                async def reward(final: pb.Sample) -> float:
                    payload = {"prompt": "", "response": final.response, "label": label}
                    async with http.post(rm_url, json=payload) as response:
                        return float(await response.json())

                rewards = await asyncio.gather(*(reward(f) for f in finals))
                if statistics.pstdev(rewards) > 1e-6 and not done.is_set():
                    accepted += 1
                    if accepted >= w.target:
                        done.set()
                        aborts = [client.abort(session_id=s) for s in list(running)]
                        rpcs += len(aborts)
                        await asyncio.gather(*aborts)

        await asyncio.gather(*(group(g, label) for g, label in enumerate(labels(w.groups))))
    return accepted, rpcs, samples_done


async def step(client: AsyncRolloutClient, rm_url: str, w: Workload, tag: str) -> tuple[int, int, int]:
    """The step as one RolloutStep; (accepted groups, RPCs made, samples generated)."""
    groups = [
        pb.PromptGroup(prompt=make_sample(PROMPT, index=g * w.n), group_index=g, label=label)
        for g, label in enumerate(labels(w.groups))
    ]
    accepted = generated = 0
    async for event in client.rollout_step(
        groups,
        n_samples_per_prompt=w.n,
        step_id=tag,
        target_groups=w.target,
        max_groups_in_flight=w.in_flight,
        params=params(w),
        reward={"kind": "REWARD_KIND_REMOTE", "url": rm_url},
        filter={"kind": "FILTER_KIND_REWARD_NONZERO_STD"},
        timeout=600,
    ):
        if event.WhichOneof("event") == "summary":
            accepted = event.summary.accepted
            generated = event.summary.progress.generated
    return accepted, 1, generated


async def measure(
    target: str, service_pid: int, rm_url: str, w: Workload, reps: int
) -> dict[str, dict[str, float]]:
    """ABBA repetitions of both paths; the best wall time of each, with the CPU time of the service
    process (psutil) and of this process (the trainer side, and the reward server) during that run."""
    best: dict[str, dict[str, float]] = {}
    order = [PATHS[i % 2] if (i // 2) % 2 == 0 else PATHS[1 - i % 2] for i in range(2 * reps)]
    async with AsyncRolloutClient(target) as client:
        for i, path in enumerate(order):
            run = hand_loop if path == PATHS[0] else step
            trainer0 = time.process_time()
            with procs.Meter({"service": service_pid}) as meter:
                started = time.perf_counter()
                accepted, rpcs, samples = await run(client, rm_url, w, f"b{i}")
                wall = time.perf_counter() - started
            trainer_s = time.process_time() - trainer0
            if path not in best or wall < best[path]["wall_s"]:
                best[path] = {
                    "wall_s": wall,
                    "accepted": accepted,
                    "rpcs": rpcs,
                    "samples": samples,
                    "service_cpu_s": meter.cpu_s["service"],
                    "trainer_cpu_s": trainer_s,
                }
    return best


async def main_async(quick: bool) -> str:
    rows = [
        "| workload | path | wall s | accepted groups/s | accepted | trainer RPCs | samples "
        "| service CPU ms/sample | trainer process CPU ms/sample |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp, procs.Processes(Path(tmp)) as group:
        for w in plan(quick):
            engines = [
                procs.start_sim(group, f"sim{w.token_delay_ms:g}-{i}", w.token_delay_ms, i).url
                for i in range(2)
            ]
            service = procs.start_service(group, f"service{w.token_delay_ms:g}", engines)
            async with RewardServer() as rm:
                best = await measure(service.target, service.proc.pid, rm.url, w, reps=1 if quick else 2)
            for path in PATHS:
                r = best[path]
                rows.append(
                    f"| {w.key} | {path} | {r['wall_s']:.2f} | {r['accepted'] / r['wall_s']:.1f} | "
                    f"{int(r['accepted'])} | {int(r['rpcs'])} | {int(r['samples'])} | "
                    f"{1000 * r['service_cpu_s'] / r['samples']:.2f} | "
                    f"{1000 * r['trainer_cpu_s'] / r['samples']:.2f} |"
                )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one small workload, one repetition")
    args = parser.parse_args()
    table = asyncio.run(main_async(args.quick))
    text = (
        "# RolloutStep vs the step written by hand\n\n"
        "One slime-style rollout step (groups of samples, a remote reward model, the nonzero-std filter,\n"
        "over-sampling, abort at the target) through one `rollout-grpc serve` process on two simulated\n"
        "engines: by hand over `Generate` + reward POSTs from the trainer, and as one `RolloutStep`\n"
        "(`python -m bench.step`; best of the alternating repetitions; a shared 2-core machine, so the\n"
        "numbers are indicative). Reading: docs/rollout-step.md. CPU per sample: the service process's\n"
        "user + system CPU time during the kept run (psutil) divided by the samples generated in it; the\n"
        "trainer process's is this benchmark's own process, which also runs the reward server (the same\n"
        "reward POSTs on both paths).\n\n" + table + "\n"
    )
    if not args.quick:
        write_section(DOCS / "benchmarks.step.md", "step", text)
    print(text)


if __name__ == "__main__":
    main()
