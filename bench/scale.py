"""`make bench-scale`: how ONE replica's CPU and memory grow with streams, engines and R3 payloads.

Why: `bench/run.py` compares the service with direct HTTP; an operator sizing a fleet needs the
other question answered: per replica, how many cores per 100k tokens/s, and how much memory per
1k concurrent streams? Each point of the table starts a fresh `rollout-grpc serve` (one process:
`--workers 1` when that flag exists) on fresh simulated engines, so its peak RSS is its own, runs
a closed loop of `streams` concurrent 256-token generations through it (20 ms per token,
`ignore_eos`, 64-token prompts, token-in/token-out, `skip_text`, default delta batching, one
logprob per token) and meters the service PID (psutil: CPU user + system, RSS every 50 ms).

Three axes around one baseline (2 engines, 256 streams, no routed experts):

* streams 64, 256, 1024, 4096 (the admission limit `--server-concurrency` is raised to the
  stream count, so every stream is admitted at once);
* engines 2, 8, 16, 32 — the engines run as several `SimEngine`s per process
  (`bench/sim_pool.py`): two pool processes, each holding half of them on its own ports;
* R3 payload per token 24x8, 48x8, 64x8 (MoE layers x top-k, uint8 ids of 128 experts, as
  `bench/r3_e2e.py`'s engine): the engines run `--moe` and every call sets
  `return_routed_experts`, so each final sample carries `(prompt + response - 1) x layers x topk`
  bytes.

On 2 shared cores the simulated engines and the load generator compete with the service: from
about 1024 streams the engines cannot keep 20 ms per token (the table shows the achieved tokens/s
per stream against the nominal 50). CPU per token stays meaningful (it is what the service spent
on the tokens it relayed); the sizing rule (`bench/sizing.py`) states which row it comes from.

Writes `docs/benchmarks.scale.json` (its own file: a `make bench` does not rerun it, and it keeps
its own commit, date and load) and re-renders `docs/benchmarks.md`. About 4 minutes;
`--quick` runs small points only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from bench import load, procs, sizing
from bench.run import DOCS, SystemCpu, Workload, environment, stream_batch_description, summarise
from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client import AsyncRolloutClient

RESULTS = "benchmarks.scale.json"
TOKEN_DELAY_MS = 20.0
MAX_TOKENS = 256
EXPERTS = 128
BASE_ENGINES = 2
BASE_STREAMS = 256
POOL_PROCESSES = 2


@dataclass(frozen=True, slots=True)
class Point:
    """One configuration of the table."""

    streams: int
    engines: int
    r3_layers: int = 0
    r3_topk: int = 0

    @property
    def requests(self) -> int:
        """Two waves of generations for small points, one for large ones (time budget)."""
        return self.streams * 2 if self.streams <= 256 else self.streams

    @property
    def label(self) -> str:
        r3 = f", R3 {self.r3_layers}x{self.r3_topk}" if self.r3_layers else ""
        return f"{self.streams} streams, {self.engines} engines{r3}"


def plan(quick: bool) -> list[Point]:
    """The baseline first, then each axis around it (the baseline is measured once)."""
    if quick:
        return [Point(64, 2), Point(128, 2), Point(64, 4), Point(64, 2, 24, 8)]
    points = [Point(BASE_STREAMS, BASE_ENGINES)]
    points += [Point(s, BASE_ENGINES) for s in (64, 1024, 4096)]
    points += [Point(BASE_STREAMS, e) for e in (8, 16, 32)]
    points += [Point(BASE_STREAMS, BASE_ENGINES, layers, 8) for layers in (24, 48, 64)]
    return points


# ----------------------------------------------------------------------------------- load


async def run_load(target: str, point: Point, requests: int, seed: int, max_tokens: int) -> load.RunResult:
    """`requests` generations, `point.streams` at a time, through the replica at `target`."""
    rng = random.Random(seed)
    parts = []
    for _ in range(requests):
        sample, params, options = load.grpc_request_parts(load.prompt(rng), max_tokens)
        options.return_routed_experts = bool(point.r3_layers)
        parts.append((sample, params, options))
    concurrency = min(point.streams, requests)
    async with AsyncRolloutClient(target) as client:
        if point.r3_layers:
            return await load.closed_loop(
                concurrency, requests, lambda i: r3_generate(client, parts[i], f"sc{seed}-{i}", point)
            )
        return await load.closed_loop(
            concurrency, requests, lambda i: load.grpc_generate(client, parts[i], f"sc{seed}-{i}")
        )


async def r3_generate(
    client: AsyncRolloutClient,
    parts: tuple[pb.Sample, pb.SamplingParams, pb.GenerateOptions],
    request_id: str,
    point: Point,
) -> load.Result:
    """A streamed generation whose final sample must carry `[tokens - 1, layers, topk]` routed experts."""
    start = time.perf_counter()
    ttft: float | None = None
    final: pb.Sample | None = None
    async for message in client.generate_stream(*parts, request_id=request_id):
        if message.HasField("delta"):
            if message.delta.token_ids and ttft is None:
                ttft = time.perf_counter() - start
        else:
            final = message.sample
    if final is None:
        raise RuntimeError("the stream ended without a sample")
    shape = list(final.routed_experts.shape)
    rows = len(final.tokens) - 1
    if shape != [rows, point.r3_layers, point.r3_topk] or len(final.routed_experts.data) != rows * (
        point.r3_layers * point.r3_topk
    ):
        raise RuntimeError(
            f"routed experts shape {shape}, expected [{rows}, {point.r3_layers}, {point.r3_topk}]"
        )
    return load.Result(
        time.perf_counter() - start, ttft, final.response_length, pb.SampleStatus.Name(final.status)
    )


# ----------------------------------------------------------------------------------- one point


def sim_flags(point: Point) -> list[str]:
    if not point.r3_layers:
        return []
    return [
        "--moe",
        "--moe-layers",
        str(point.r3_layers),
        "--moe-topk",
        str(point.r3_topk),
        "--moe-experts",
        str(EXPERTS),
    ]


def measure_point(group: procs.Processes, point: Point, index: int, max_tokens: int) -> dict[str, Any]:
    """Fresh engines and a fresh replica for `point`; one measured closed-loop run."""
    pools = [
        procs.start_sim_pool(
            group,
            f"p{index}-pool{i}",
            share,
            TOKEN_DELAY_MS,
            seed=i * 1000,
            extra=sim_flags(point),
        )
        for i, share in enumerate(split_engines(point.engines, POOL_PROCESSES))
        if share
    ]
    engines = [url for pool in pools for url in pool.urls]
    limit = max(512, point.streams)
    service = procs.start_service(group, f"p{index}-service", engines, ["--server-concurrency", str(limit)])
    idle_rss = psutil.Process(service.proc.pid).memory_info().rss
    seed = index * 7919
    asyncio.run(run_load(service.target, point, min(point.streams, 32), -seed, 16))  # warm-up
    pids = {"client": os.getpid(), "service": service.proc.pid}
    pids |= {f"engine{i}": pool.proc.pid for i, pool in enumerate(pools)}
    workload = Workload(TOKEN_DELAY_MS, point.streams, point.requests, 1)
    system = SystemCpu()
    with procs.Meter(pids, interval_s=0.05) as meter:
        run = asyncio.run(run_load(service.target, point, point.requests, seed, max_tokens))
    row = summarise("service", workload, run, meter, system.elapsed())
    row.update(asdict(point))
    row["r3_bytes_per_token"] = point.r3_layers * point.r3_topk
    row["service_idle_rss_mib"] = round(idle_rss / 2**20, 1)
    row["service_cores"] = round(row["service_cpu_s"] / run.wall_s, 3)
    row["tokens_per_s_per_stream"] = round(row["tokens_per_s"] / point.streams, 1)
    row["nominal_tokens_per_s_per_stream"] = round(1000 / TOKEN_DELAY_MS, 1)
    print(
        f"  {point.label:36s} {row['tokens_per_s']:>8,.0f} tok/s "
        f"({row['tokens_per_s_per_stream']:.1f}/stream)  "
        f"svc {row['service_cpu_s_per_mtok'] or 0:6.1f} s/Mtok {row['service_cores']:.2f} cores  "
        f"rss {row['service_peak_rss_mib'] or 0:6.0f} MiB (idle {row['service_idle_rss_mib']:.0f})  "
        f"errors {row['errors']}  other load {row['other_load_cores']}",
        flush=True,
    )
    return row


def split_engines(total: int, parts: int) -> list[int]:
    """`total` engines over `parts` processes, as evenly as possible."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run(quick: bool) -> dict[str, Any]:
    started = time.monotonic()
    env = environment()
    rows: list[dict[str, Any]] = []
    max_tokens = 64 if quick else MAX_TOKENS
    workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-scale-"))
    try:
        with procs.Processes(workdir) as group:
            for index, point in enumerate(plan(quick)):
                try:
                    rows.append(measure_point(group, point, index, max_tokens))
                finally:
                    group.stop_all()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base_streams = 64 if quick else BASE_STREAMS
    return {
        "benchmark": "rollout-grpc one replica at scale (simulated engines)",
        "environment": env,
        "settings": {
            "token_delay_ms": TOKEN_DELAY_MS,
            "max_new_tokens": max_tokens,
            "prompt_tokens": load.PROMPT_LEN,
            "quick": quick,
            "stream_batch": stream_batch_description(),
            "serve_flags": [*procs.one_process_flags(), "--server-concurrency", "max(512, streams)"],
            "engine_processes": POOL_PROCESSES,
            "r3_experts": EXPERTS,
            "base_engines": BASE_ENGINES,
            "base_streams": base_streams,
        },
        "rows": rows,
        "sizing": sizing.derive(rows, BASE_ENGINES, base_streams),
        "duration_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small points, short responses")
    parser.add_argument("--out-dir", type=Path, default=DOCS)
    parser.add_argument(
        "--rederive",
        action="store_true",
        help="measure nothing: recompute the sizing rule of the stored rows (after a change to "
        "bench/sizing.py) and re-render benchmarks.md",
    )
    args = parser.parse_args(argv)
    if args.rederive:
        path = args.out_dir / RESULTS
        stored = json.loads(path.read_text())
        base = stored["settings"]
        stored["sizing"] = sizing.derive(stored["rows"], base["base_engines"], base["base_streams"])
        path.write_text(json.dumps(stored, indent=2) + "\n")
        from bench.real_vllm import rerender

        rerender(args.out_dir)
        print(f"sizing: {stored['sizing']}")
        return 0
    print("scale: one replica, simulated engines at 20 ms per token", flush=True)
    results = run(args.quick)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / RESULTS).write_text(json.dumps(results, indent=2) + "\n")
    from bench.real_vllm import rerender

    rerender(args.out_dir)
    rule = results["sizing"]
    print(
        f"sizing: {rule['cores_per_100k_tok_s']} cores per 100k tokens/s, "
        f"{rule['rss_mib_per_1k_streams']} MiB per 1k streams (+{rule['fixed_rss_mib']} MiB fixed); "
        f"done in {results['duration_s']} s: {args.out_dir / RESULTS}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
