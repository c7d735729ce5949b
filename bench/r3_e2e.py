"""R3 end to end: routed experts of a Qwen3-30B-A3B-shaped engine, direct vs through the service.

Why this exists: `bench/r3.py` compares the encodings in one process; this row measures what a
trainer sees on the wire and on the clock when it asks for a sample *with* its routed experts at
the sizes R3 runs at (4k and 32k new tokens, 48 MoE layers x top-8 of 128 experts, uint8 ids).
A simulated vLLM engine (`python -m rollout_grpc.sim --moe --moe-layers 48 --moe-topk 8
--moe-experts 128`, no per-token delay, so the transport is what is timed) serves both paths:

* `direct` — one non-streaming `POST /inference/v1/generate` (tokens, one logprob per token); the
  answer carries `choices[0].routed_experts` as vLLM does: base64 of an `.npy` inside the JSON.
  Decoded with orjson, `b64decode` and `np.load` into the array a trainer wants.
* `service` — `AsyncRolloutClient.generate()` (`final_only`, `skip_text`, `return_routed_experts`)
  through one `rollout-grpc serve` process: one `GenerateResponse` whose sample carries
  `RoutedExperts{bytes data, dtype, shape}`; the array is `np.frombuffer(...).reshape(shape)`.

Bytes are the payload the caller receives (HTTP body; serialized protobuf messages), without
HTTP/1.1, HTTP/2 or TCP framing. Time is from sending the request to holding the array, best of
the repetitions (paths alternate, ABBA). Service CPU is the service process's user + system time.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson

from bench import procs
from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client import AsyncRolloutClient
from tests.support.processes import Processes

LAYERS = 48
TOPK = 8
EXPERTS = 128
PROMPT = [1 + (i * 37) % 2000 for i in range(64)]
#: (label, new tokens, repetitions per path)
SIZES: tuple[tuple[str, int, int], ...] = (("4k", 4096, 4), ("32k", 32768, 2))
QUICK_SIZES: tuple[tuple[str, int, int], ...] = (("4k", 4096, 1), ("32k", 32768, 1))
TIMEOUT_S = 600.0


@dataclass(slots=True)
class Fetch:
    """One sample with its routed experts, as the caller got it."""

    wire_bytes: int
    wall_s: float
    rows: int
    new_tokens: int


def _check(array: np.ndarray, new_tokens: int) -> int:
    rows = len(PROMPT) + new_tokens - 1
    if array.shape != (rows, LAYERS, TOPK) or array.dtype != np.uint8:
        raise RuntimeError(
            f"routed experts {array.shape} {array.dtype}, expected ({rows}, {LAYERS}, {TOPK}) uint8"
        )
    return rows


async def fetch_direct(
    session: aiohttp.ClientSession, engine: str, new_tokens: int, request_id: str
) -> Fetch:
    """One non-streaming generate straight from the engine, decoded to the routed-experts array."""
    body = {
        "request_id": request_id,
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": new_tokens, "ignore_eos": True, "temperature": 0.0, "logprobs": 1},
        "stream": False,
    }
    start = time.perf_counter()
    async with session.post(
        f"{engine}/inference/v1/generate",
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
    ) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
    choice = orjson.loads(raw)["choices"][0]
    array = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"], validate=True)), allow_pickle=False)
    wall = time.perf_counter() - start
    if len(choice["token_ids"]) != new_tokens:
        raise RuntimeError(f"{len(choice['token_ids'])} tokens, expected {new_tokens}")
    return Fetch(len(raw), wall, _check(array, new_tokens), new_tokens)


async def fetch_service(client: AsyncRolloutClient, new_tokens: int, request_id: str) -> Fetch:
    """One final-only Generate through the service, to the routed-experts array."""
    sample = pb.Sample(tokens=PROMPT, status=pb.SAMPLE_STATUS_PENDING)
    params = pb.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    options = pb.GenerateOptions(skip_text=True, final_only=True, return_routed_experts=True)
    start = time.perf_counter()
    wire = 0
    final: pb.Sample | None = None
    async for message in client.generate_stream(
        sample, params, options, request_id=request_id, timeout=TIMEOUT_S
    ):
        wire += message.ByteSize()
        if message.HasField("sample"):
            final = message.sample
    if final is None:
        raise RuntimeError("the stream ended without a sample")
    experts = final.routed_experts
    array = np.frombuffer(experts.data, dtype=np.uint8).reshape(tuple(experts.shape))
    wall = time.perf_counter() - start
    if final.response_length != new_tokens:
        raise RuntimeError(f"{final.response_length} tokens, expected {new_tokens}: {final.failure_reason}")
    return Fetch(wire, wall, _check(array, new_tokens), new_tokens)


def _row(path: str, label: str, fetches: list[Fetch], service_cpu_s: list[float]) -> dict[str, Any]:
    best = min(fetches, key=lambda f: f.wall_s)
    return {
        "size": label,
        "path": path,
        "new_tokens": best.new_tokens,
        "shape": [best.rows, LAYERS, TOPK],
        "wire_bytes": best.wire_bytes,
        "wall_ms": round(best.wall_s * 1000, 1),
        "reps_wall_ms": [round(f.wall_s * 1000, 1) for f in fetches],
        "service_cpu_ms": round(min(service_cpu_s) * 1000, 1) if service_cpu_s else None,
    }


async def _measure(
    engine: str, target: str, service_pid: int, sizes: tuple[tuple[str, int, int], ...]
) -> list[dict[str, Any]]:
    meter_pids = {"service": service_pid}
    rows: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session, AsyncRolloutClient(target) as client:
        await fetch_direct(session, engine, 16, "r3-warm-d")  # warm-up: connections, code paths
        await fetch_service(client, 16, "r3-warm-s")
        for label, new_tokens, reps in sizes:
            direct: list[Fetch] = []
            service: list[Fetch] = []
            service_cpu: list[float] = []
            for rep in range(reps):
                order = ("direct", "service") if rep % 2 == 0 else ("service", "direct")
                for path in order:
                    request_id = f"r3-{label}-{path}-{rep}"
                    if path == "direct":
                        direct.append(await fetch_direct(session, engine, new_tokens, request_id))
                        continue
                    with procs.Meter(meter_pids, interval_s=0.05) as meter:
                        service.append(await fetch_service(client, new_tokens, request_id))
                    service_cpu.append(meter.cpu_s["service"])
            base = _row("direct", label, direct, [])
            row = _row("service", label, service, service_cpu)
            print(
                f"  R3 {label}: direct {base['wall_ms']:8.1f} ms {base['wire_bytes']:>11,} B   "
                f"service {row['wall_ms']:8.1f} ms {row['wire_bytes']:>11,} B",
                flush=True,
            )
            row["bytes_vs_direct"] = round(row["wire_bytes"] / base["wire_bytes"], 3)
            row["time_vs_direct"] = round(row["wall_ms"] / base["wall_ms"], 3)
            rows += [base, row]
    return rows


def run(group: Processes, quick: bool = False) -> dict[str, Any]:
    """Start the MoE engine and one service on it, measure both paths at both sizes."""
    sizes = QUICK_SIZES if quick else SIZES
    longest = max(tokens for _, tokens, _ in sizes)
    moe = ["--moe", "--moe-layers", str(LAYERS), "--moe-topk", str(TOPK), "--moe-experts", str(EXPERTS)]
    engine = procs.start_sim(
        group, "r3-engine", 0.0, seed=0, extra=[*moe, "--max-model-len", str(longest + len(PROMPT) + 64)]
    ).url
    service = procs.start_service(group, "r3-service", [engine])
    rows = asyncio.run(_measure(engine, service.target, service.proc.pid, sizes))
    return {
        "benchmark": "r3_end_to_end",
        "engine": f"simulated MoE, {LAYERS} layers x top-{TOPK} of {EXPERTS} experts, no per-token delay",
        "prompt_tokens": len(PROMPT),
        "rows": rows,
    }


def markdown(results: dict[str, Any]) -> list[str]:
    """The end-to-end R3 table (lines of Markdown)."""
    out = [
        "## R3 end to end: a sample with its routed experts, direct vs through the service",
        "",
        f"One {results['engine']} engine (`python -m rollout_grpc.sim --moe ...`), "
        f"{results['prompt_tokens']}-token prompt, greedy, `ignore_eos`. **direct**: one non-streaming "
        "`POST /inference/v1/generate`, `routed_experts` as vLLM sends it (base64 `.npy` in JSON), decoded "
        "with orjson + `np.load`. **service**: `AsyncRolloutClient.generate()` (`final_only`, `skip_text`, "
        "`return_routed_experts`), `RoutedExperts` bytes read with `np.frombuffer`. Bytes are the payload "
        "the caller receives (HTTP body / serialized protobuf, no framing); time is from the request to "
        "the array in hand, best of the repetitions (`bench/r3_e2e.py`).",
        "",
        "| new tokens | routed experts shape | path | bytes received | vs direct | ms to the array "
        "| vs direct | service CPU ms |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["rows"]:
        shape = " x ".join(str(d) for d in row["shape"])
        cpu = "-" if row["service_cpu_ms"] is None else f"{row['service_cpu_ms']:,.0f}"
        out.append(
            f"| {row['new_tokens']:,} | {shape} | {row['path']} | {row['wire_bytes']:,} "
            f"({row['wire_bytes'] / 2**20:,.2f} MiB) | {row.get('bytes_vs_direct', 1.0):.3f} "
            f"| {row['wall_ms']:,.1f} | {row.get('time_vs_direct', 1.0):.2f} "
            f"| {cpu} |"
        )
    out.append("")
    return out
