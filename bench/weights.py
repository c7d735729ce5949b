"""A/B of the time the fleet is paused per weight update: UpdateWeights against the engines' own calls.

Why: a trainer waits on the weight update at every step, and the fleet generates nothing while it
runs. Done by hand, an update is what a trainer that knows every engine sends: `/pause?mode=keep`
to every engine, `/collective_rpc reload_weights` to every engine, `/update_weight_version`, then
`/resume` — each step concurrently across the engines. The service does the same calls plus its
own work (the checkpoint check before the pause, asking the engines' labels, the rotation
bookkeeping), and by default loads on one engine first (`staged`). This measures, on 2 and 8
simulated engines (one process, `bench/sim_pool.py`) behind one service process:

* `direct`: pause of the first engine to the last resume, by hand;
* `service all_at_once` / `service staged`: `UpdateWeightsResponse.paused_seconds` (the service's
  first pause to its last resume) and the call's wall time seen by the client;

with the load's own share (`load_seconds`). The simulator's load reads the safetensors headers and
rebuilds its toy model (~1-3 ms); the goal is paused time <= 1.1x direct plus the load itself.

The ratios are **paired**: each repetition runs the three updates back to back (in rotating order)
and the ratio is the median over repetitions of service / direct within the repetition. On a shared
machine whose load drifts, a ratio of two medians taken at different moments mixes the drift in;
the paired median does not. Both are written (`paused_vs_direct` paired, `ratio_*` of medians).

    python -m bench.weights --reps 41 --json docs/benchmarks.weights.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench import procs
from bench.run import environment
from rollout_grpc.client import AsyncRolloutClient
from tests.support.checkpoints import toy_checkpoint

ENGINE_COUNTS = (2, 8)


async def direct_update(http: aiohttp.ClientSession, urls: list[str], path: str, version: str) -> float:
    """Pause -> load -> label -> resume on every engine by hand; seconds from first pause to last resume."""

    async def each(method: str, route: str, **kwargs: Any) -> None:
        async def one(url: str) -> None:
            async with http.request(method, url + route, **kwargs) as resp:
                assert resp.status == 200, f"{url}{route}: {resp.status} {await resp.text()}"

        await asyncio.gather(*(one(url) for url in urls))

    began = time.perf_counter()
    await each("POST", "/pause", params={"mode": "keep"}, json={})
    await each("POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}})
    await each("POST", "/update_weight_version", json={"new_version": version})
    await each("POST", "/resume", json={})
    return time.perf_counter() - began


async def measure(target: str, urls: list[str], path: str, reps: int) -> dict[str, Any]:
    """`reps` rounds of direct, all-at-once and staged updates, in rotating order."""
    rows: dict[str, list[float]] = {
        "direct": [],
        "all_at_once_paused": [],
        "all_at_once_wall": [],
        "all_at_once_load": [],
        "staged_paused": [],
        "staged_wall": [],
        "staged_load": [],
    }
    version = 0
    async with aiohttp.ClientSession() as http, AsyncRolloutClient(target) as client:

        async def service(kind: str) -> None:
            nonlocal version
            version += 1
            began = time.perf_counter()
            response = await client.update_weights(path, str(version), all_at_once=kind == "all_at_once")
            rows[f"{kind}_wall"].append(time.perf_counter() - began)
            rows[f"{kind}_paused"].append(response.paused_seconds)
            rows[f"{kind}_load"].append(response.load_seconds)

        async def direct() -> None:
            nonlocal version
            version += 1
            rows["direct"].append(await direct_update(http, urls, path, f"direct-{version}"))

        async def all_at_once() -> None:
            await service("all_at_once")

        async def staged() -> None:
            await service("staged")

        steps: list[Callable[[], Awaitable[None]]] = [direct, all_at_once, staged]
        await service("all_at_once")  # warm-up (connections, the first model tables): not counted
        for values in rows.values():
            values.clear()
        for rep in range(reps):
            for step in steps[rep % 3 :] + steps[: rep % 3]:
                await step()
    result: dict[str, Any] = {key: statistics.median(values) for key, values in rows.items()}
    for kind in ("all_at_once", "staged"):
        pairs = [s / d for s, d in zip(rows[f"{kind}_paused"], rows["direct"], strict=True)]
        result[f"{kind}_paused_vs_direct"] = statistics.median(pairs)
        result[f"{kind}_paused_vs_direct_quartiles"] = [
            round(q, 3) for q in statistics.quantiles(pairs, n=4)[::2]
        ]
    return result


def run(engines: int, reps: int, workdir: Path) -> dict[str, Any]:
    checkpoint = toy_checkpoint(workdir / "ckpt" / "v", seed=1)
    with procs.Processes(workdir / f"procs-{engines}") as group:
        pool = procs.start_sim_pool(group, f"sims-{engines}", engines, token_delay_ms=1.0, seed=0)
        service = procs.start_service(
            group, f"service-{engines}", pool.urls, ["--weights-path-prefix", str(workdir / "ckpt")]
        )
        result = asyncio.run(measure(service.target, pool.urls, str(checkpoint), reps))
    result["engines"] = engines
    result["ratio_all_at_once"] = result["all_at_once_paused"] / result["direct"]
    result["ratio_staged"] = result["staged_paused"] / result["direct"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None, help="write the medians here")
    args = parser.parse_args(argv)
    results = []
    env = environment()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        for engines in ENGINE_COUNTS:
            results.append(run(engines, args.reps, Path(tmp)))
    print("engines  direct ms  all-at-once paused (wall, load) ms  staged paused (wall, load) ms  paired")
    for r in results:
        print(
            f"{r['engines']:>7}  {r['direct'] * 1e3:9.1f}  "
            f"{r['all_at_once_paused'] * 1e3:8.1f} ({r['all_at_once_wall'] * 1e3:6.1f}, "
            f"{r['all_at_once_load'] * 1e3:5.1f})          "
            f"{r['staged_paused'] * 1e3:8.1f} ({r['staged_wall'] * 1e3:6.1f}, {r['staged_load'] * 1e3:5.1f})"
            f"       {r['all_at_once_paused_vs_direct']:.2f} / {r['staged_paused_vs_direct']:.2f}"
        )
    if args.json is not None:
        document = {
            "benchmark": "weight update: paused time, UpdateWeights vs the engines' own calls by hand",
            "environment": env,
            "duration_s": round(time.perf_counter() - began, 1),
            "reps": args.reps,
            "rows": results,
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
