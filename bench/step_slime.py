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
(own processes, 10 ms per token by default), the service one `rollout-grpc serve` process.

Why paired ratios: the machine is shared and its load drifts over minutes, so a ratio of two
medians taken at different moments mixes the drift in. Each repetition runs every path back to
back, in ABBA order (reversed every other repetition), and the reported ratio is the median over
repetitions of the per-repetition ratio, with its quartiles and range.

**engine waves** (the floor): the samples of the waves slime's loop submitted in that repetition
(`started / target` batches of `target x n` samples) posted straight to the engines, one wave after
the other, with the same prompts, seeds and session-to-engine split, no reward and no service. Both
paths must wait for a wave to end before the filter can drop a group and the next batch can start,
and the target is reached only when the last batch's samples end, so this is the time no client of
these engines can beat at this rule.

**Phases** (seconds from the path's start, as its client sees them): `setup` the step's first
event (its checks, reward probe, store reads and first admission; 0 for the hand loop), `first
sample` the first sample ended, `second batch` the second over-sampling batch was submitted (the
step: the first progress event counting more groups started than the target), `target` the target
was reached.

    python -m bench.step_slime [--targets 32 128] [--reps 6] [--before SRC] [--py-spy DIR]

writes `docs/benchmarks.step_slime.json` (rendered into docs/benchmarks.md by `bench/report.py`)
and the per-repetition table into `docs/benchmarks.step.md` (unless `--no-write`). `--before SRC`
adds a path "RolloutStep (before)" on a second service running the `rollout_grpc` package of SRC
(e.g. `git worktree add /tmp/before HEAD~1`): a before/after of the step in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import procs
from bench.load import SIM_MODEL
from bench.run import environment
from bench.step import DOCS, write_section
from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.support.reward_server import RewardServer

PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301, 835, 38, 2, 206, 1, 72, 345, 80, 1653, 206]
LOOP, STEP, BEFORE, FLOOR = "slime loop over Generate", "RolloutStep", "RolloutStep (before)", "engine waves"
#: Reward requests at once on both paths (slime's remote_rm connection limit).
REWARD_CONNECTIONS = 64
JSON_FILE = DOCS / "benchmarks.step_slime.json"
PHASES = ("setup_s", "first_sample_s", "second_batch_s", "target_s")


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
    #: Seconds from the start to each phase (see the module docstring); absent: not reached.
    phases: dict[str, float] = field(default_factory=dict)


class Clock:
    """Seconds since a path started; `mark` keeps the first time of each phase."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self.start

    def mark(self, phase: str) -> None:
        self.phases.setdefault(phase, round(self.now(), 4))


def _commit_of(checkout: Path) -> str:
    """The commit a `--before` checkout is at (recorded instead of its path, which is this
    machine's and says nothing to a reader of docs/)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "a checkout that is not a git work tree"
    return out.stdout.strip()


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
    clock = Clock()
    clock.mark("setup_s")
    # slime's remote_rm shares one session of at most 64 connections (rm_hub `_get_shared_session`).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=REWARD_CONNECTIONS)) as http:

        async def sample(g: int, i: int, label: str) -> float | None:
            prompt, _ = supply[g]
            s = make_sample(prompt, index=g * w.n + i, group_index=g, session_id=f"{tag}-g{g}")
            final = await client.generate(s, {**params(w), "seed": 7 + i}, {"final_only": True})
            clock.mark("first_sample_s")
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
                if submitted > w.target:
                    clock.mark("second_batch_s")
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
        if accepted >= w.target:
            clock.mark("target_s")
        if pending:  # slime aborts every engine until idle: one Abort of this caller's generations
            await client.abort(mine=True)
        await asyncio.gather(*pending, return_exceptions=True)
    note = f"{aborted} groups came back ABORTED" if aborted else ""
    if accepted < w.target:
        note = f"the prompt groups ran out; {note}"
    return Result(clock.now(), submitted, min(accepted, w.target), note, clock.phases)


async def rollout_step(client: AsyncRolloutClient, rm_url: str, w: Workload, tag: str) -> Result:
    """The same step as one RolloutStep (default policy: slime's rule)."""
    supply = groups(w)
    messages = [
        pb.PromptGroup(prompt=make_sample(prompt, index=g * w.n), group_index=g, label=label)
        for g, (prompt, label) in enumerate(supply)
    ]
    clock = Clock()
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
        kind = event.WhichOneof("event")
        if kind == "summary":
            summary = event.summary
        elif kind == "progress":
            p = event.progress
            clock.mark("setup_s")
            if p.generated:
                clock.mark("first_sample_s")
            if p.in_flight + p.accepted + sum(p.dropped.values()) > w.target:
                clock.mark("second_batch_s")
            if p.accepted >= w.target:
                clock.mark("target_s")
    assert summary is not None
    return Result(
        clock.now(),
        len(supply) - len(summary.unstarted_group_indexes),
        summary.accepted,
        "" if summary.target_reached else f"{summary.reason} (dropped {dict(summary.progress.dropped)})",
        clock.phases,
    )


async def engine_waves(engines: list[str], w: Workload, waves: int) -> Result:
    """The floor: `waves` batches of `target x n` samples straight to the engines, one after the
    other (a group's samples on one engine, as the session affinity places them)."""
    supply = groups(w)
    clock = Clock()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1200)) as http:

        async def sample(g: int, i: int) -> None:
            body = {
                "request_id": f"waves-{g}-{i}-{time.monotonic_ns()}",
                "token_ids": supply[g][0],
                "model": SIM_MODEL,
                "sampling_params": {
                    "max_tokens": w.tokens,
                    "ignore_eos": True,
                    "temperature": 1.0,
                    "seed": 7 + i,
                    "logprobs": 0,
                    "stream_interval": w.tokens,
                },
                "stream": True,
            }
            url = engines[g % len(engines)] + "/inference/v1/generate"
            async with http.post(
                url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
            ) as r:
                if r.status != 200:
                    raise RuntimeError(f"engine answered HTTP {r.status}: {(await r.read())[:200]!r}")
                await r.read()

        for wave in range(waves):
            first = wave * w.target
            await asyncio.gather(*(sample(g, i) for g in range(first, first + w.target) for i in range(w.n)))
            clock.mark(f"wave_{wave + 1}_s")
    ends = ", ".join(f"wave {k + 1} ended at {clock.phases[f'wave_{k + 1}_s']:.2f} s" for k in range(waves))
    return Result(clock.now(), waves * w.target, 0, ends, clock.phases)


@contextlib.contextmanager
def profiled(pid: int, out: Path | None) -> Iterator[None]:
    """With `--py-spy DIR`: py-spy samples the service process during one path (collapsed stacks,
    for `bench.pyspy_top`); it costs CPU, so such runs measure nothing."""
    if out is None:
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    spy = subprocess.Popen(
        [
            binary,
            "record",
            "--format",
            "raw",
            "--nonblocking",
            "--rate",
            "100",
            "--pid",
            str(pid),
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


@dataclass(slots=True)
class Services:
    """The replicas a run talks to: the step's (this checkout) and, with `--before`, the old one."""

    current: procs.Replica
    before: procs.Replica | None
    engines: list[str]


async def measure(
    services: Services, rm_url: str, w: Workload, reps: int, floor: bool, spy: Path | None
) -> list[dict[str, Result]]:
    """Per repetition, every path's result; the paths in ABBA order (reversed every other rep)."""
    paths = [LOOP, STEP] + ([BEFORE] if services.before is not None else [])
    reps_out: list[dict[str, Result]] = []
    async with contextlib.AsyncExitStack() as stack:
        clients = {LOOP: await stack.enter_async_context(AsyncRolloutClient(services.current.target))}
        clients[STEP] = clients[LOOP]
        if services.before is not None:
            clients[BEFORE] = await stack.enter_async_context(AsyncRolloutClient(services.before.target))
        for rep in range(reps):
            results: dict[str, Result] = {}
            for path in paths if rep % 2 == 0 else paths[::-1]:
                service = services.before if path == BEFORE else services.current
                assert service is not None
                run = slime_loop if path == LOOP else rollout_step
                name = f"{w.target}-{path.split()[0].lower()}{'-before' if path == BEFORE else ''}-{rep}"
                with profiled(service.proc.pid, spy / f"{name}.txt" if spy else None):
                    results[path] = await run(clients[path], rm_url, w, f"s{w.target}-{rep}-{len(results)}")
            if floor:
                waves = max(1, results[LOOP].started // w.target)
                results[FLOOR] = await engine_waves(services.engines, w, waves)
            reps_out.append(results)
            print(
                f"G={w.target} rep {rep + 1}: "
                + ", ".join(f"{p} {r.wall_s:.2f} s" for p, r in results.items())
            )
    return reps_out


def spread(values: list[float]) -> dict[str, Any]:
    """Median, quartiles and range of per-repetition ratios."""
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {
        "median": round(statistics.median(ordered), 3),
        "quartiles": [round(quartiles[0], 3), round(quartiles[2], 3)],
        "range": [round(ordered[0], 3), round(ordered[-1], 3)],
        "per_rep": [round(v, 3) for v in values],
    }


def row(w: Workload, reps: list[dict[str, Result]], load: tuple[list[float], list[float]]) -> dict[str, Any]:
    """One target's row of benchmarks.step_slime.json: raw results and the paired ratios."""

    def ratio(path: str, base: str, attr: str) -> dict[str, Any] | None:
        pairs = [getattr(r[path], attr) / getattr(r[base], attr) for r in reps if path in r and base in r]
        return spread(pairs) if pairs else None

    paths = [p for p in (LOOP, STEP, BEFORE, FLOOR) if p in reps[0]]
    out: dict[str, Any] = {
        "target_groups": w.target,
        "n": w.n,
        "reps": len(reps),
        "load_average": {"start": load[0], "end": load[1]},
        "paths": {
            p: {
                "wall_s": [round(r[p].wall_s, 3) for r in reps],
                "groups_started": [r[p].started for r in reps],
                "accepted": [r[p].accepted for r in reps],
                "notes": [r[p].note for r in reps if r[p].note],
                "phases_median_s": {
                    phase: round(statistics.median(values), 3)
                    for phase in {k for r in reps for k in r[p].phases}
                    if (values := [r[p].phases[phase] for r in reps if phase in r[p].phases])
                },
            }
            for p in paths
        },
        "wall_vs_hand_loop": ratio(STEP, LOOP, "wall_s"),
        "groups_vs_hand_loop": ratio(STEP, LOOP, "started"),
    }
    optional = {
        "wall_vs_engine_waves": ratio(STEP, FLOOR, "wall_s"),
        "hand_loop_wall_vs_engine_waves": ratio(LOOP, FLOOR, "wall_s"),
        "wall_vs_before": ratio(STEP, BEFORE, "wall_s"),
        "before_wall_vs_hand_loop": ratio(BEFORE, LOOP, "wall_s"),
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def table(rows: list[tuple[Workload, list[dict[str, Result]]]]) -> str:
    """The per-repetition Markdown table of benchmarks.step.md."""
    lines = [
        "| target G | n | path | rep | wall s | groups started | accepted | started vs loop "
        "| wall vs loop | setup s | first sample s | second batch s | target s | note |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for w, reps in rows:
        for rep, results in enumerate(reps):
            base = results[LOOP]
            for path, r in results.items():
                ph = [f"{r.phases[k]:.2f}" if k in r.phases else "-" for k in PHASES]
                lines.append(
                    f"| {w.target} | {w.n} | {path} | {rep + 1} | {r.wall_s:.2f} | {r.started} | "
                    f"{r.accepted} | {r.started / base.started:.2f}x | {r.wall_s / base.wall_s:.2f}x | "
                    + " | ".join(ph)
                    + f" | {r.note} |"
                )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    measured: list[tuple[Workload, list[dict[str, Result]]]] = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-step-slime-") as tmp, procs.Processes(Path(tmp)) as group:
        engines = [procs.start_sim(group, f"sim-{i}", args.delay_ms, i).url for i in range(2)]
        current = procs.start_service(group, "service", engines)
        before = procs.start_service(group, "before", engines, src=args.before) if args.before else None
        services = Services(current, before, engines)
        async with RewardServer() as rm:
            for target in args.targets:
                w = Workload(target, args.n, args.tokens, args.delay_ms)
                load_start = [round(x, 2) for x in os.getloadavg()]
                begun = time.perf_counter()
                reps = await measure(
                    services, rm.url, w, args.reps, target in args.floor_targets, args.py_spy
                )
                load_end = [round(x, 2) for x in os.getloadavg()]
                measured.append((w, reps))
                rows.append(row(w, reps, (load_start, load_end)))
                rows[-1]["run"] = {
                    "commit": args.commit,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                    "duration_s": round(time.perf_counter() - begun, 1),
                }
    return rows, table(measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", type=int, nargs="+", default=[32, 128], help="target groups G")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="simulated ms per token")
    parser.add_argument("--reps", type=int, default=6, help="repetitions (each runs every path, ABBA)")
    parser.add_argument(
        "--floor-targets", type=int, nargs="*", default=[32], help="targets that also run the engine waves"
    )
    parser.add_argument("--before", type=Path, default=None, help="a checkout whose RolloutStep runs too")
    parser.add_argument("--py-spy", type=Path, default=None, help="profile the service per path here")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    started = time.perf_counter()
    env = environment()
    args.commit = env["commit"]
    rows, per_rep = asyncio.run(main_async(args))
    document = {
        "environment": env,
        "duration_s": round(time.perf_counter() - started, 1),
        "settings": {
            "tokens": args.tokens,
            "token_delay_ms": args.delay_ms,
            "engines": 2,
            "reward_connections": REWARD_CONNECTIONS,
            "reps": args.reps,
            "before": _commit_of(args.before) if args.before else None,
            "profiled": args.py_spy is not None,
        },
        "rows": rows,
    }
    text = (
        "## RolloutStep (default over-sampling) vs slime's loop over Generate, per repetition\n\n"
        f"`python -m bench.step_slime --reps {args.reps}` ({args.tokens} tokens per sample, "
        f"{args.delay_ms:g} ms per token, two simulated engines, one service process, a remote reward "
        "and the nonzero-std filter). The paired ratios and the setup are in docs/benchmarks.md "
        "(`benchmarks.step_slime.json`); this is every repetition. 'vs loop' compares with the slime "
        "loop of the same repetition; phase times are seconds from the path's start "
        "(bench/step_slime.py). Load average at start "
        f"{env['load_average_at_start']}.\n\n" + per_rep + "\n"
    )
    print(text)
    print(json.dumps([{k: v for k, v in r.items() if k != "paths"} for r in rows], indent=1))
    if not args.no_write and args.py_spy is None:
        write_section(DOCS / "benchmarks.step.md", f"step-slime-{'-'.join(map(str, args.targets))}", text)
        write_json(JSON_FILE, document)


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write `document`, keeping the rows of other targets already in `path` (a run of one target
    at a time replaces only its own row; every row names its run's commit, date and load)."""
    targets = {r["target_groups"] for r in document["rows"]}
    if path.exists():
        old = json.loads(path.read_text())
        kept = [r for r in old.get("rows", []) if r["target_groups"] not in targets]
        document = {**document, "rows": sorted([*kept, *document["rows"]], key=lambda r: r["target_groups"])}
    path.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
