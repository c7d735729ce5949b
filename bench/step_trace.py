"""Where RolloutStep loses time against slime's loop over Generate, read off the engines' clock.

`bench/step_slime.py` times each path from its client; its phase marks are different events on
the two paths (a progress message vs a Generate's return). This runs the same two paths (same
prompts, seeds, reward server) against simulated engines that log when each generate request
arrived and ended (`bench/sim_traced.py`), and a reward server that logs when each reward request
arrived and was answered, and prints, per path and repetition, seconds from the path's start:

* `arr1` first / last engine request of the first batch arriving at an engine;
* `end1` first / last sample of the first batch ending on its engine;
* `rm1` first reward request arriving / last reward answered of the first batch;
* `drop` the first group of the first batch whose samples all ended and that is dropped (its
  label scores every sample 1.0) ends (its last sample) -> `arr2` the first request of the second
  batch arrives: the refill latency, reward scoring included;
* `arr2`/`end2` the second batch's first arrival and last end; `wall`;
* `dur1`/`dur2` min / median / max seconds from a request's arrival to its end (the engine's
  own time per sample: the simulated engine's per-request token timers lag more when many
  requests tick together).

    python -m bench.step_trace [--target 32] [--reps 4] [--before SRC]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from bench import procs
from bench.step_slime import Workload, groups, rollout_step, slime_loop
from rollout_grpc.client import AsyncRolloutClient
from tests.support.processes import REPO, Engine, fresh_port_file, read_port_file
from tests.support.reward_server import RewardServer


class TimedRewards(RewardServer):
    """The bench's reward server, logging (arrived, answered) per reward request."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[tuple[float, float]] = []

    async def _handle(self, request: web.Request) -> web.Response:
        arrived = time.time()
        try:
            return await super()._handle(request)
        finally:
            self.times.append((arrived, time.time()))


def start_traced_sim(group: procs.Processes, name: str, delay_ms: float, seed: int, trace: Path) -> str:
    port_file = fresh_port_file(group.workdir / f"{name}.port")
    argv = [
        sys.executable,
        "-m",
        "bench.sim_traced",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--token-delay-ms",
        str(delay_ms),
        "--seed",
        str(seed),
        "--eos-probability",
        "0",
        "--max-model-len",
        "8192",
    ]
    os.environ["SIM_TRACE"] = str(trace)
    try:
        proc = group.start(name, argv, cwd=REPO)
    finally:
        del os.environ["SIM_TRACE"]
    return Engine(proc, int(read_port_file(port_file, proc))).url


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    """Minimum, median and maximum, rounded."""
    return (round(min(values), 3), round(statistics.median(values), 3), round(max(values), 3))


def analyse(w: Workload, t0: float, t1: float, traces: list[Path], rm: TimedRewards) -> dict[str, Any]:
    rows = []
    for trace in traces:
        for line in trace.read_bytes().splitlines():
            r = orjson.loads(line)
            if t0 <= r["arrived"] <= t1:
                rows.append(r)
    labels = [label for _, label in groups(w)]

    def rel(t: float) -> float:
        return round(t - t0, 3)

    batch1 = [r for r in rows if r["last_token"] - 100 < w.target]
    batch2 = [r for r in rows if w.target <= r["last_token"] - 100 < 2 * w.target]
    ends: dict[int, float] = {}
    for r in batch1:
        g = r["last_token"] - 100
        ends[g] = max(ends.get(g, 0.0), r["ended"])
    dropped = [ends[g] for g in ends if labels[g] == "one"]
    rms = [(a, b) for a, b in rm.times if t0 <= a <= t1]
    arr2 = min((r["arrived"] for r in batch2), default=None)
    rm1 = [(a, b) for a, b in rms if arr2 is None or a < arr2]
    out: dict[str, Any] = {
        "arr1": (rel(min(r["arrived"] for r in batch1)), rel(max(r["arrived"] for r in batch1))),
        "end1": (rel(min(r["ended"] for r in batch1)), rel(max(r["ended"] for r in batch1))),
        "rm1": (rel(min(a for a, _ in rm1)), rel(max(b for _, b in rm1))) if rm1 else None,
        "drop": rel(min(dropped)) if dropped else None,
        "arr2": rel(arr2) if arr2 is not None else None,
        "end2": rel(max(r["ended"] for r in batch2)) if batch2 else None,
        "dur1": _quantiles([r["ended"] - r["arrived"] for r in batch1]),
        "dur2": _quantiles([r["ended"] - r["arrived"] for r in batch2]) if batch2 else None,
        "wall": rel(t1),
        "requests": len(rows),
    }
    if out["drop"] is not None and out["arr2"] is not None:
        out["refill"] = round(out["arr2"] - out["drop"], 3)
    return out


async def run(args: argparse.Namespace) -> None:
    w = Workload(args.target, args.n, args.tokens, args.delay_ms)
    with tempfile.TemporaryDirectory(prefix="bench-step-trace-") as tmp, procs.Processes(Path(tmp)) as group:
        traces = [Path(tmp) / f"sim-{i}.trace" for i in range(2)]
        engines = [start_traced_sim(group, f"sim-{i}", args.delay_ms, i, traces[i]) for i in range(2)]
        current = procs.start_service(group, "service", engines)
        before = procs.start_service(group, "before", engines, src=args.before) if args.before else None
        paths: list[tuple[str, str]] = [("loop", current.target), ("step", current.target)]
        if before is not None:
            paths.append(("before", before.target))
        results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in paths}
        rm = TimedRewards()
        async with rm:
            clients = {t: AsyncRolloutClient(t) for t in {t for _, t in paths}}
            for c in clients.values():
                await c.__aenter__()
            try:
                for rep in range(args.reps):
                    order = paths if rep % 2 == 0 else paths[::-1]
                    for name, target in order:
                        fn = slime_loop if name == "loop" else rollout_step
                        t0 = time.time()
                        await fn(clients[target], rm.url, w, f"t{rep}-{name}")
                        t1 = time.time()
                        await asyncio.sleep(0.3)  # the engines' trace lines of this path are written
                        res = analyse(w, t0, t1, traces, rm)
                        results[name].append(res)
                        print(f"rep {rep} {name:6s} {res}", flush=True)
            finally:
                for c in clients.values():
                    await c.__aexit__(None, None, None)
    print("\nmedians (s from the path's start):")
    for name, reps in results.items():
        summary = {}
        for key in ("arr1", "end1", "dur1", "rm1", "drop", "arr2", "refill", "dur2", "end2", "wall"):
            values = [r[key] for r in reps if r.get(key) is not None]
            if not values:
                continue
            if isinstance(values[0], tuple):
                summary[key] = tuple(
                    round(statistics.median(v[i] for v in values), 3) for i in range(len(values[0]))
                )
            else:
                summary[key] = round(statistics.median(values), 3)
        print(f"  {name:6s} {summary}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--before", type=Path, default=None)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
