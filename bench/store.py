"""What the shared state store costs a RolloutStep with `leftovers=BUFFER`, and what a buffered group
weighs in it (issue 37 item 6), so an operator can size Redis.

One round = a step that buffers `G` groups (group 0 nearly done and accepted at once, `G` groups
still generating are aborted into the caller's buffer) + the `continue_buffered` step that takes
them back and finishes them. The same rounds run against three replicas:

* `in-process` — `serve --workers 1`, the buffer in the process's memory;
* `embedded x2` — `serve --workers 2`, the supervisor's store over its unix socket, the continue
  step on the other worker than the buffering one;
* `redis` — `serve --workers 1 --state-store redis://...` (a redis-server on loopback).

Every step also names the groups it holds only in its process in the store whenever that set
changes (`DrainLease.hold`, one round trip per group start and end), so the per-group cost here
includes those writes; the store calls per round are counted on Redis (`INFO commandstats`).

Why paired: the machine is small and shared, so its load moves between rounds. Each repetition
runs every store at G=2 and G=16 in alternating order (ABBA); the ratios against in-process
(`*_vs_in_process`) and the overheads in ms are taken within a repetition, then their median and
quartiles over the repetitions are reported, with the load average before and after.

Per store and repetition the line through G=2 and G=16 gives the cost per extra group (put + take
+ encode/decode + hold writes) and the fixed cost of a round (two steps: lease, holding, take).

Memory: 4 buffered groups of `N` samples (a random prompt and `DONE` generated tokens of a
65,536-token vocabulary each, logprobs, masks), once without and once with R3 (routed experts of
a Qwen3-30B-A3B-shaped engine: 48 MoE layers x top-8 of 128 experts, uint8 ids, asked for with
`return_routed_experts`), through a fourth replica on the same Redis whose engine is that MoE,
read back from Redis: `MEMORY USAGE` of the owner's group list and the
replica's own estimate (`bytes:<owner>`, what the caps count), per group and per token (the tokens
and R3 bytes counted in the decoded groups). Engines are simulated (`python -m rollout_grpc.sim
--moe ...`, 1 ms a token). `python -m bench.store [--quick]` writes `docs/benchmarks.store.md` and
the `store` part of `docs/benchmarks.json` (re-rendering `docs/benchmarks.md`); `make bench` runs
it as its `store` section (`python -m bench.run --no-store` leaves it out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from bench import procs
from bench.sections import num
from bench.step import write_section
from rollout_grpc.client import AsyncRolloutClient, make_sample, pb, routed_experts_message
from rollout_grpc.server.rollout.step.buffer import decode_group
from tests.support.processes import Processes, start_replica
from tests.support.redis_server import redis_binary, start_redis
from tests.support.workers import clients_by_worker

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: The sized groups' vocabulary (its ids above 255 take 3 bytes in a pickle; a vocabulary over
#: 65,536, e.g. Qwen's 151,936, takes 5 for ids above that: about 2 more bytes per such token).
#: The timed rounds use the simulator's default 2,048 (a large vocabulary slows every simulated
#: token, which would only dilute what the store costs).
VOCAB = 65_536
TIMED_VOCAB = 2048
#: Samples per group, tokens each buffered sample already holds, and its budget. The continue step
#: generates 16 more tokens a sample: enough to be a real step, few enough that the engines' time
#: (and its noise on 2 shared cores) does not hide what the store costs.
N = 8
DONE = 1024
BUDGET = DONE + 16
PROMPT_TOKENS = 20
#: Groups buffered to size them (the figures are per group and per token).
SIZED_GROUPS = 4
#: Repetitions of `make bench` (each runs every store at both sizes, ~4 s).
REPS = 21
SIZES = (2, 16)
#: R3 shape of the sized groups with routed experts (Qwen3-30B-A3B: uint8 ids).
LAYERS, TOPK, EXPERTS = 48, 8, 128
STORES = ("in-process", "embedded x2", "redis")
#: The example the sizing formula is worked for: groups x samples x tokens per sample.
EXAMPLE = (128, 8, 4096)


def _partials(
    rng: random.Random, prompt: list[int], first: int, done: int, r3: bool, vocab: int
) -> list[pb.Sample]:
    """`N` ABORTED samples of an earlier step with `done` random response tokens and logprobs (and
    their routing when `r3`), as a trainer hands partial samples back."""
    out = []
    for i in range(N):
        response = [rng.randrange(vocab) for _ in range(done)]
        sample = pb.Sample(
            tokens=[*prompt, *response],
            index=first + i,
            response_length=done,
            loss_mask=[1] * done,
            rollout_log_probs=[-rng.expovariate(1.0) for _ in range(done)],
            status=pb.SAMPLE_STATUS_ABORTED,
            finish_reason=pb.FINISH_REASON_ABORT,
            start_step_id="earlier",
        )
        if r3:
            rows = len(prompt) + done - 1
            routing = np.random.default_rng(first + i).integers(0, EXPERTS, (rows, LAYERS, TOPK), np.uint8)
            sample.routed_experts.CopyFrom(routed_experts_message(routing))
        out.append(sample)
    return out


def _groups(g: int, r3: bool = False, vocab: int = TIMED_VOCAB) -> list[pb.PromptGroup]:
    """Group 0 one token short of its budget (accepted at once), then `g` groups still generating."""
    rng = random.Random(g)
    prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
    quick = _partials(rng, prompt, 0, BUDGET - 1, r3, vocab)
    return [pb.PromptGroup(prompt=make_sample(prompt), group_index=0, partial=quick)] + [
        pb.PromptGroup(
            prompt=make_sample(prompt), group_index=i, partial=_partials(rng, prompt, N * i, DONE, r3, vocab)
        )
        for i in range(1, g + 1)
    ]


async def _drain(call: AsyncIterator[pb.RolloutStepResponse]) -> pb.StepSummary:
    """The step's summary; a failed group fails the benchmark with its reason."""
    summary: pb.StepSummary | None = None
    failed: list[str] = []
    async for event in call:
        kind = event.WhichOneof("event")
        if kind == "summary":
            summary = event.summary
        elif kind == "group" and event.group.outcome == pb.GROUP_OUTCOME_FAILED:
            failed.append(f"group {event.group.group_index}: {event.group.reason}")
    assert summary is not None and not failed, (summary, failed[:3])
    return summary


PARAMS = {"temperature": 1.0, "max_new_tokens": BUDGET, "ignore_eos": True}


async def _buffer(client: AsyncRolloutClient, groups: list[pb.PromptGroup], name: str, r3: bool) -> None:
    options = {"return_routed_experts": True} if r3 else None
    g = len(groups) - 1
    first = await _drain(
        client.rollout_step(
            groups, n_samples_per_prompt=N, params=PARAMS, options=options, target_groups=1,
            max_groups_in_flight=g + 1, over_sampling="keep_in_flight", leftovers="buffer",
            buffer_name=name, timeout=300,
        )
    )  # fmt: skip
    assert first.buffered == g, first


async def _continue(client: AsyncRolloutClient, name: str, g: int, r3: bool) -> None:
    options = {"return_routed_experts": True} if r3 else None
    second = await _drain(
        client.rollout_step(
            [], n_samples_per_prompt=N, params=PARAMS, options=options, continue_buffered=True,
            buffer_name=name, timeout=300,
        )
    )  # fmt: skip
    assert second.accepted == g and second.buffered == 0, second


async def _round(
    writer: AsyncRolloutClient, reader: AsyncRolloutClient, groups: list[pb.PromptGroup], name: str
) -> float:
    start = time.perf_counter()
    await _buffer(writer, groups, name, False)
    await _continue(reader, name, len(groups) - 1, False)
    return (time.perf_counter() - start) * 1000


async def _script_calls(store: aioredis.Redis) -> int:
    """Store operations Redis has run so far (each is one Lua script call: one round trip)."""
    stats = await store.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


async def _sizes(client: AsyncRolloutClient, store: aioredis.Redis, g: int, r3: bool) -> dict[str, float]:
    """Redis's bytes per buffered group (MEMORY USAGE of the list), the replica's estimate, and the
    tokens and R3 bytes the decoded groups hold."""
    name = "sizing-r3" if r3 else "sizing"
    await _buffer(client, _groups(g, r3, VOCAB), name, r3)
    owner = f"anonymous#{name}"
    used = int(await store.memory_usage(f"rollout:g:{owner}", samples=0) or 0)
    estimate = int(await store.get(f"rollout:bytes:{owner}") or 0)
    tokens = r3_bytes = blobs = 0
    for blob in await store.lrange(f"rollout:g:{owner}", 0, -1):
        assert isinstance(blob, bytes)  # the client decodes no responses
        blobs += len(blob)
        group = decode_group(blob)
        for item in group.partial:
            tokens += item.sample.token_count
            if item.sample.routed_experts is not None:
                r3_bytes += int(item.sample.routed_experts.array.nbytes)
    # Not continued: a large vocabulary makes every simulated token slow, and the sizes are known.
    # The groups stay in this benchmark's Redis, which stops with it.
    return {
        "groups": g,
        "redis_bytes_per_group": used / g,
        "estimate_bytes_per_group": estimate / g,
        "tokens_per_group": tokens / g,
        "r3_bytes_per_token": r3_bytes / tokens if tokens else 0.0,
        "redis_bytes_per_token": used / tokens if tokens else 0.0,
        # The pickled groups themselves: Redis rounds each value up to its allocator's size class.
        "blob_bytes_per_token": blobs / tokens if tokens else 0.0,
        "estimate_bytes_per_token": estimate / tokens if tokens else 0.0,
    }


async def _memory(group: Processes, url: str, store: aioredis.Redis) -> dict[str, dict[str, float]]:
    """The sized groups, through a replica on the same Redis whose engine is MoE (R3) with a
    `VOCAB`-token vocabulary."""
    moe = ["--moe", "--moe-layers", str(LAYERS), "--moe-topk", str(TOPK), "--moe-experts", str(EXPERTS)]
    engine = procs.start_sim(group, "store-moe-engine", 1.0, 7, extra=[*moe, "--vocab-size", str(VOCAB)])
    # Not timed: a generous idle timeout, so the simulated engine computing R3 arrays on a starved
    # core is waited for instead of failed over (nothing else to fail over to).
    flags = ["--log-level", "warning", "--workers", "1", "--state-store", url, "--engine-idle-timeout", "120"]
    replica = start_replica(group, "store-sizing", [engine.url], flags)
    async with AsyncRolloutClient(replica.target, retry=None) as client:
        return {
            "no_r3": await _sizes(client, store, SIZED_GROUPS, False),
            "r3": await _sizes(client, store, SIZED_GROUPS, True),
        }


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [round(q[0], 3), round(q[2], 3)]


def summarise(times: dict[str, dict[int, list[float]]]) -> list[dict[str, Any]]:
    """Per store: the medians, and against in-process the paired ratios (`*_vs_in_process`) and
    overheads in ms, each the median over repetitions (quartiles next to it).

    `times[store][g]` are the round times in ms, one per repetition, in repetition order.
    """
    small, large = SIZES
    base = times["in-process"]
    reps = len(base[small])

    def fit(store: str, r: int) -> tuple[float, float]:
        """(ms per round without groups, ms per extra group) of repetition `r`."""
        a, b = times[store][small][r], times[store][large][r]
        per_group = (b - a) / (large - small)
        return a - small * per_group, per_group

    rows = []
    for store, by_g in times.items():
        fits = [fit(store, r) for r in range(reps)]
        base_fits = [fit("in-process", r) for r in range(reps)]
        row: dict[str, Any] = {
            "store": store,
            "reps": reps,
            "round_ms_small": round(statistics.median(by_g[small]), 1),
            "round_ms_large": round(statistics.median(by_g[large]), 1),
            "per_group_ms": round(statistics.median(f[1] for f in fits), 2),
            "per_group_ms_quartiles": _quartiles([f[1] for f in fits]),
        }
        rows.append(row)
        if store == "in-process":  # the baseline: its ratios would be 1 by definition
            continue
        paired = {
            "round_small_vs_in_process": [by_g[small][r] / base[small][r] for r in range(reps)],
            "round_large_vs_in_process": [by_g[large][r] / base[large][r] for r in range(reps)],
            "per_group_vs_in_process": [
                fits[r][1] / base_fits[r][1] if base_fits[r][1] > 0 else float("nan") for r in range(reps)
            ],
        }
        for key, values in paired.items():
            kept = [v for v in values if not math.isnan(v)]
            row[key] = round(statistics.median(kept), 3) if kept else None
            row[f"{key}_quartiles"] = _quartiles(kept)
        # A round is two steps: the fixed part's difference, halved, is the overhead per step.
        step = [(fits[r][0] - base_fits[r][0]) / 2 for r in range(reps)]
        group = [fits[r][1] - base_fits[r][1] for r in range(reps)]
        row["step_overhead_ms"] = round(statistics.median(step), 2)
        row["step_overhead_ms_quartiles"] = _quartiles(step)
        row["group_overhead_ms"] = round(statistics.median(group), 2)
        row["group_overhead_ms_quartiles"] = _quartiles(group)
    return rows


def sizing(memory: dict[str, dict[str, float]]) -> dict[str, float]:
    """Bytes per generated token in Redis and in the caps' estimate, without and with R3, and the
    worked example (`EXAMPLE` groups x samples x tokens) in MiB."""
    plain, r3 = memory["no_r3"], memory["r3"]
    tokens = EXAMPLE[0] * EXAMPLE[1] * EXAMPLE[2]
    return {
        "redis_bytes_per_token": round(plain["redis_bytes_per_token"], 1),
        "redis_bytes_per_token_r3": round(r3["redis_bytes_per_token"], 1),
        "estimate_bytes_per_token": round(plain["estimate_bytes_per_token"], 1),
        "estimate_bytes_per_token_r3": round(r3["estimate_bytes_per_token"], 1),
        "example_tokens": tokens,
        "example_redis_mib": round(tokens * plain["redis_bytes_per_token"] / 2**20),
        "example_redis_mib_r3": round(tokens * r3["redis_bytes_per_token"] / 2**20),
        "example_estimate_mib": round(tokens * plain["estimate_bytes_per_token"] / 2**20),
        "example_estimate_mib_r3": round(tokens * r3["estimate_bytes_per_token"] / 2**20),
    }


async def measure(group: Processes, rounds: int) -> dict[str, Any]:
    binary = redis_binary()
    assert binary is not None, "redis-server is not installed"
    redis = start_redis(group, binary, random.Random())
    engines = [procs.start_sim(group, f"store-engine-{i}", 1.0, i).url for i in range(2)]
    flags = ["--log-level", "warning"]
    one = start_replica(group, "store-in-process", engines, [*flags, "--workers", "1"])
    two = start_replica(group, "store-embedded", engines, [*flags, "--workers", "2"])
    shared = start_replica(
        group, "store-redis", engines, [*flags, "--workers", "1", "--state-store", redis.url]
    )
    load_start = list(os.getloadavg())
    started = time.monotonic()
    store = aioredis.Redis.from_url(redis.url)
    try:
        async with (
            AsyncRolloutClient(one.target, retry=None) as c1,
            AsyncRolloutClient(shared.target, retry=None) as c3,
            clients_by_worker(two.target, 2) as by_worker,
        ):
            pairs: dict[str, Callable[[list[pb.PromptGroup], str], Awaitable[float]]] = {
                "in-process": lambda gs, n: _round(c1, c1, gs, n),
                "embedded x2": lambda gs, n: _round(by_worker[0], by_worker[1], gs, n),
                "redis": lambda gs, n: _round(c3, c3, gs, n),
            }
            groups = {g: _groups(g) for g in SIZES}
            calls: dict[int, int] = {}
            for store_name in STORES:  # warm-up, not timed; Redis's store calls per round counted
                for g in SIZES:
                    before = await _script_calls(store)
                    await pairs[store_name](groups[g], f"warm-{g}")
                    if store_name == "redis":
                        calls[g] = await _script_calls(store) - before
            times: dict[str, dict[int, list[float]]] = {s: {g: [] for g in SIZES} for s in STORES}
            loads = []
            for r in range(rounds):
                for store_name in STORES if r % 2 == 0 else reversed(STORES):
                    for g in SIZES:
                        times[store_name][g].append(await pairs[store_name](groups[g], f"b-{r}-{g}"))
                loads.append(os.getloadavg()[0])
            stats = await store.info("commandstats")
            script = stats.get("cmdstat_evalsha", {})
            memory = await _memory(group, redis.url, store)
    finally:
        await store.aclose()
    return {
        "settings": {
            "samples_per_group": N,
            "done_tokens": DONE,
            "budget": BUDGET,
            "prompt_tokens": PROMPT_TOKENS,
            "sizes": list(SIZES),
            "token_delay_ms": 1.0,
            "r3": f"{LAYERS} layers x top-{TOPK} of {EXPERTS} experts, uint8",
            "reps": rounds,
        },
        "rows": summarise(times),
        "times_ms": {
            s: {str(g): [round(t, 1) for t in v] for g, v in by_g.items()} for s, by_g in times.items()
        },
        "redis_store_calls_per_round": {str(g): n for g, n in calls.items()},
        # Redis's own time per store call (a Lua script), over the timed rounds (and the warm-up).
        "redis_usec_per_call": script.get("usec_per_call"),
        "memory": memory,
        "sizing": sizing(memory),
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "load_average_1m_max": round(max(loads), 2) if loads else None,
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "duration_s": round(time.monotonic() - started, 1),
    }


def run(group: Processes, quick: bool = False) -> dict[str, Any]:
    """`make bench`'s store section: 3 repetitions with `quick`, else `REPS`."""
    return asyncio.run(measure(group, 3 if quick else REPS))


def _spread(row: dict[str, Any], key: str, fmt: str) -> str:
    q = row.get(f"{key}_quartiles") or []
    spread = f" [{format(q[0], fmt)}, {format(q[1], fmt)}]" if len(q) == 2 else ""
    return f"{num(row.get(key), fmt)}{spread}"


def markdown(data: dict[str, Any]) -> list[str]:
    """The store section of docs/benchmarks.md (and docs/benchmarks.store.md)."""
    s = data["settings"]
    small, large = s["sizes"]
    calls = data.get("redis_store_calls_per_round", {})
    lines = [
        "## The state store: RolloutStep with BUFFER, in-process vs embedded vs Redis",
        "",
        f"Generated by `python -m bench.store` (also `make bench`'s `store` section). Round = a BUFFER "
        f"step that buffers G groups of {s['samples_per_group']} samples ({s['done_tokens']} generated "
        f"tokens each) + the continue step that finishes them ({s['budget'] - s['done_tokens']} more "
        f"tokens each at {s['token_delay_ms']:g} ms a token, 2 simulated engines); {s['reps']} "
        "repetitions, each running every store at G="
        f"{small} and G={large} in alternating order (ABBA). Ratios and overheads are paired within a "
        "repetition, then the median over repetitions, quartiles in brackets. Each step also writes "
        "the groups it holds in its process to the store as they change (`hold_groups`, one round "
        f"trip per group start and end): Redis ran {calls.get(str(small), '?')} store calls a round "
        f"at G={small} and {calls.get(str(large), '?')} at G={large}, "
        f"{num(data.get('redis_usec_per_call'), '.0f')} µs each inside Redis.",
        "",
        f"Code: commit {data.get('commit', '?')}. **Caveat**: {data.get('cpus', '?')} shared cores; "
        f"load average {data['load_average_start']} at "
        f"the start, {data['load_average_end']} at the end (1-minute peak {data['load_average_1m_max']}), "
        f"{data['duration_s']} s. The absolute times carry that load; the paired ratios cancel most "
        "of it, the quartiles show what is left.",
        "",
        f"| store | ms per round G={small} | G={large} | ms per extra group | round G={small} "
        f"vs in-process | round G={large} vs in-process | per group vs in-process | overhead ms per "
        "step | overhead ms per group |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['store']} | {num(row['round_ms_small'])} | {num(row['round_ms_large'])} "
            f"| {_spread(row, 'per_group_ms', '.1f')} | {_spread(row, 'round_small_vs_in_process', '.2f')} "
            f"| {_spread(row, 'round_large_vs_in_process', '.2f')} "
            f"| {_spread(row, 'per_group_vs_in_process', '.2f')} | {_spread(row, 'step_overhead_ms', '.1f')} "
            f"| {_spread(row, 'group_overhead_ms', '.2f')} |"
        )
    memory, rule = data["memory"], data["sizing"]
    plain, r3 = memory["no_r3"], memory["r3"]
    groups, samples, per_sample = EXAMPLE
    lines += [
        "",
        f"Memory per buffered group ({plain['groups']} groups in Redis, {s['samples_per_group']} samples x "
        f"{plain['tokens_per_group'] / s['samples_per_group']:,.0f} tokens: random ids of a "
        f"{VOCAB:,}-token vocabulary, logprobs, masks; R3: {s['r3']}, "
        f"{r3['r3_bytes_per_token']:.0f} bytes per token):",
        "",
        "| group | Redis `MEMORY USAGE` KiB | bytes per token | the pickled group, bytes per token "
        "| the replica's estimate (the caps) KiB | bytes per token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, m in (("no R3", plain), ("with R3", r3)):
        lines.append(
            f"| {label} | {m['redis_bytes_per_group'] / 1024:,.0f} | {m['redis_bytes_per_token']:.1f} "
            f"| {num(m.get('blob_bytes_per_token'), '.1f')} | {m['estimate_bytes_per_group'] / 1024:,.0f} "
            f"| {m['estimate_bytes_per_token']:.1f} |"
        )
    lines += [
        "",
        f"Sizing: Redis holds ~{rule['redis_bytes_per_token']:.0f} bytes per buffered token "
        f"(~{rule['redis_bytes_per_token_r3']:.0f} with R3); the caps count "
        f"~{rule['estimate_bytes_per_token']:.0f} (~{rule['estimate_bytes_per_token_r3']:.0f}). "
        f"Example, {groups} groups x {samples} samples x {per_sample:,} tokens: Redis "
        f"{rule['example_redis_mib']:,} MiB ({rule['example_redis_mib_r3']:,} MiB with R3), "
        f"`--step-buffer-mb` at least {rule['example_estimate_mib']:,} "
        f"({rule['example_estimate_mib_r3']:,} with R3). Redis rounds each group's value up to its "
        "allocator's size class (the pickled group is smaller), so with R3 its bytes per token sit "
        "close to the caps' estimate.",
        "",
    ]
    return lines


def write_page(data: dict[str, Any], out_dir: Path) -> None:
    """docs/benchmarks.store.md (the section alone, under its own title)."""
    out = out_dir / "benchmarks.store.md"
    if not out.exists():
        out.write_text(
            "# The state store: RolloutStep with BUFFER\n\n<!-- begin store -->\n<!-- end store -->\n"
        )
    write_section(out, "store", "\n".join(markdown(data)[2:]))


def write(data: dict[str, Any], out_dir: Path) -> None:
    """docs/benchmarks.store.md, and the `store` part of benchmarks.json (benchmarks.md re-rendered)
    when that file exists: the other sections of benchmarks.json stay as they were."""
    write_page(data, out_dir)
    results_path = out_dir / "benchmarks.json"
    if results_path.exists():
        from bench.report import write_markdown  # it imports this module (for its section)

        results = json.loads(results_path.read_text())
        results["store"] = data
        results_path.write_text(json.dumps(results, indent=2) + "\n")
        write_markdown(results, out_dir / "benchmarks.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"3 repetitions instead of {REPS}")
    parser.add_argument("--reps", type=int, default=0, help=f"repetitions (default {REPS}, 3 with --quick)")
    parser.add_argument("--out-dir", type=Path, default=DOCS)
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else REPS)
    with tempfile.TemporaryDirectory() as tmp, procs.Processes(Path(tmp)) as group:
        data = asyncio.run(measure(group, reps))
    print("\n".join(markdown(data)))
    write(data, args.out_dir)


def _commit() -> str:
    """The code measured (the short commit), as the other side files record it."""
    import subprocess

    return subprocess.run(
        ["git", "-C", str(procs.REPO), "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
    ).stdout.strip()


if __name__ == "__main__":
    main()
