"""What the shared state store costs a RolloutStep with `leftovers=BUFFER`, and what a buffered group
weighs in it (issue 37 item 6), so an operator can size Redis.

One round = a step that buffers `G` groups (group 0 nearly done and accepted at once, `G` groups
still generating are aborted into the caller's buffer) + the `continue_buffered` step that takes
them back and finishes them. The same rounds run against three replicas, alternating (ABBA), the
median kept per store:

* `in-process` — `serve --workers 1`, the buffer in the process's memory;
* `embedded x2` — `serve --workers 2`, the supervisor's store over its unix socket, the continue
  step on the other worker than the buffering one;
* `redis` — `serve --workers 1 --state-store redis://...` (a redis-server on loopback).

Per store: ms per round at G=2 and at G=16, and the difference per extra group (the per-group
cost of put + take + encode/decode). The buffered groups carry `DONE` generated tokens per sample
(their partial samples), so their size is known: Redis's `MEMORY USAGE` of the owner's group list
and the replica's own estimate (`bytes:<owner>`) are read after a buffering step, per group and
per token. Engines are simulated (`python -m rollout_grpc.sim`, 1 ms a token).
`python -m bench.store [--quick]` writes `docs/benchmarks.store.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis

from bench import procs
from bench.step import write_section
from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.support.partials import aborted_partials
from tests.support.processes import start_replica
from tests.support.redis_server import redis_binary, start_redis
from tests.support.workers import clients_by_worker

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301, 835, 38, 2, 206, 1, 72, 345, 80, 1653, 206]
#: Samples per group, tokens each buffered sample already holds, and its budget.
N = 8
DONE = 1024
BUDGET = DONE + 64
SIZES = (2, 16)


def _groups(g: int) -> list[pb.PromptGroup]:
    quick = pb.PromptGroup(
        prompt=make_sample(PROMPT), group_index=0, partial=aborted_partials(PROMPT, 0, N, BUDGET - 1)
    )
    return [quick] + [
        pb.PromptGroup(
            prompt=make_sample(PROMPT), group_index=i, partial=aborted_partials(PROMPT, N * i, N, DONE)
        )
        for i in range(1, g + 1)
    ]


async def _drain(call: AsyncIterator[pb.RolloutStepResponse]) -> pb.StepSummary:
    summary: pb.StepSummary | None = None
    async for event in call:
        if event.WhichOneof("event") == "summary":
            summary = event.summary
    assert summary is not None
    return summary


async def _round(writer: AsyncRolloutClient, reader: AsyncRolloutClient, g: int, name: str) -> float:
    params = {"temperature": 1.0, "max_new_tokens": BUDGET, "ignore_eos": True}
    start = time.perf_counter()
    first = await _drain(
        writer.rollout_step(
            _groups(g), n_samples_per_prompt=N, params=params, target_groups=1, max_groups_in_flight=g + 1,
            over_sampling="keep_in_flight", leftovers="buffer", buffer_name=name, timeout=300,
        )
    )  # fmt: skip
    assert first.buffered == g, first
    second = await _drain(
        reader.rollout_step(
            [], n_samples_per_prompt=N, params=params, continue_buffered=True, buffer_name=name, timeout=300
        )
    )
    assert second.accepted == g and second.buffered == 0, second
    return (time.perf_counter() - start) * 1000


async def _sizes(client: AsyncRolloutClient, url: str, g: int) -> tuple[float, float]:
    """Redis's bytes per buffered group (MEMORY USAGE of the list) and the replica's estimate."""
    name = "sizing"
    params = {"temperature": 1.0, "max_new_tokens": BUDGET, "ignore_eos": True}
    first = await _drain(
        client.rollout_step(
            _groups(g), n_samples_per_prompt=N, params=params, target_groups=1, max_groups_in_flight=g + 1,
            over_sampling="keep_in_flight", leftovers="buffer", buffer_name=name, timeout=300,
        )
    )  # fmt: skip
    assert first.buffered == g
    store = aioredis.Redis.from_url(url)
    try:
        owner = f"anonymous#{name}"
        used = int(await store.memory_usage(f"rollout:g:{owner}", samples=0) or 0)
        estimate = int(await store.get(f"rollout:bytes:{owner}") or 0)
    finally:
        await store.aclose()
    await _drain(
        client.rollout_step(
            [], n_samples_per_prompt=N, params=params, continue_buffered=True, buffer_name=name, timeout=300
        )
    )
    return used / g, estimate / g


async def measure(rounds: int) -> dict[str, object]:
    binary = redis_binary()
    assert binary is not None, "redis-server is not installed"
    with tempfile.TemporaryDirectory() as tmp, procs.Processes(Path(tmp)) as group:
        redis = start_redis(group, binary, random.Random())
        engines = [procs.start_sim(group, f"engine-{i}", 1.0, i).url for i in range(2)]
        flags = ["--log-level", "warning"]
        one = start_replica(group, "in-process", engines, [*flags, "--workers", "1"])
        two = start_replica(group, "embedded", engines, [*flags, "--workers", "2"])
        shared = start_replica(
            group, "redis", engines, [*flags, "--workers", "1", "--state-store", redis.url]
        )
        async with (
            AsyncRolloutClient(one.target, retry=None) as c1,
            AsyncRolloutClient(shared.target, retry=None) as c3,
            clients_by_worker(two.target, 2) as by_worker,
        ):
            pairs: dict[str, Callable[[int, str], Awaitable[float]]] = {
                "in-process": lambda g, n: _round(c1, c1, g, n),
                "embedded x2": lambda g, n: _round(by_worker[0], by_worker[1], g, n),
                "redis": lambda g, n: _round(c3, c3, g, n),
            }
            times: dict[tuple[str, int], list[float]] = {(s, g): [] for s in pairs for g in SIZES}
            order = list(pairs)
            for r in range(rounds):
                for store in order if r % 2 == 0 else reversed(order):
                    for g in SIZES:
                        times[(store, g)].append(await pairs[store](g, f"b-{r}-{g}"))
            per_group, estimate = await _sizes(c3, redis.url, SIZES[-1])
    rows = {}
    for store in pairs:
        small, large = (statistics.median(times[(store, g)]) for g in SIZES)
        rows[store] = {"small": small, "large": large, "per_group": (large - small) / (SIZES[1] - SIZES[0])}
    return {
        "rows": rows,
        "redis_bytes_per_group": per_group,
        "estimate_per_group": estimate,
        "rounds": rounds,
    }


def render(data: dict[str, object]) -> str:
    rows = data["rows"]
    assert isinstance(rows, dict)
    base = rows["in-process"]
    lines = [
        f"Round = a BUFFER step that buffers G groups of {N} samples ({DONE} generated tokens each) + the "
        f"continue step that finishes them; median of {data['rounds']} rounds per store, ABBA "
        "(`python -m bench.store`). 2 simulated engines, 1 ms a token.",
        "",
        f"| store | ms per round, G={SIZES[0]} | ms per round, G={SIZES[1]} | ms per extra group | "
        "vs in-process, per group |",
        "|---|---:|---:|---:|---:|",
    ]
    for store, row in rows.items():
        lines.append(
            f"| {store} | {row['small']:.0f} | {row['large']:.0f} | {row['per_group']:.2f} | "
            f"{row['per_group'] - base['per_group']:+.2f} |"
        )
    used, estimate = float(data["redis_bytes_per_group"]), float(data["estimate_per_group"])  # type: ignore[arg-type]
    tokens = N * (len(PROMPT) + DONE)
    lines += [
        "",
        f"Redis memory per buffered group ({N} samples x {len(PROMPT)} prompt + {DONE} generated tokens, "
        f"logprobs, no R3): {used / 1024:.0f} KiB by `MEMORY USAGE` ({used / tokens:.1f} bytes per token); "
        f"the replica's estimate that the caps count: {estimate / 1024:.0f} KiB ({estimate / tokens:.1f} "
        "bytes per token). R3 adds layers x top-k x 2 bytes (uint16) per token.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 15")
    args = parser.parse_args()
    data = asyncio.run(measure(3 if args.quick else 15))
    text = render(data)
    print(text)
    out = DOCS / "benchmarks.store.md"
    if not out.exists():
        out.write_text(
            "# The state store: RolloutStep with BUFFER\n\n<!-- begin store -->\n<!-- end store -->\n"
        )
    write_section(out, "store", text)


if __name__ == "__main__":
    main()
