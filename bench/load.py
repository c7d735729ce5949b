"""Load generators: the same closed-loop workload sent directly to the engines or through the service.

Why a closed loop: an RL rollout keeps a fixed number of generations in flight (slime's semaphore
of `server_concurrency x engines`) and starts the next one when one finishes, so `concurrency`
workers each run requests back to back until `requests` have been sent. Both paths carry the same
request: a prompt of random token ids, `max_tokens` 256, `ignore_eos`, temperature 1, one logprob
per token, streamed, token-in/token-out.

* `direct`: an aiohttp client posting to `/inference/v1/generate` on the engines round-robin, the
  way vime's streaming rollout does (`stream: true`, `logprobs: 1`, accumulate `token_ids` and
  `logprobs.content[*].logprob` from every delta chunk), parsing SSE lines with orjson.
* `grpc`: `rollout_grpc.client.AsyncRolloutClient.generate_stream` on one channel, reading the
  token deltas and the final sample (`skip_text`, so both paths run the engines in tokens mode).

Latency is from sending the request to the last byte of the answer (the final sample / `[DONE]`);
TTFT is from sending the request to the first message that carries a token.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client import AsyncRolloutClient

PROMPT_LEN = 64
VOCAB = 2048
_DATA = b"data: "
_DONE = b"[DONE]"


@dataclass(slots=True)
class Result:
    """One generation as the client saw it."""

    latency_s: float
    ttft_s: float | None
    tokens: int
    finish: str
    #: Stream messages received, the final sample included (0 for direct HTTP).
    messages: int = 0


@dataclass(slots=True)
class RunResult:
    """A closed-loop run: every request's result and the wall time of the whole run."""

    results: list[Result]
    wall_s: float
    errors: int


def prompt(rng: random.Random) -> list[int]:
    """A random prompt (distinct per request, so no engine-side caching can help one path)."""
    return [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]


async def closed_loop(concurrency: int, requests: int, one: Callable[[int], Awaitable[Result]]) -> RunResult:
    """Run `requests` calls of `one(i)` with `concurrency` workers; errors are counted, not raised."""
    counter = iter(range(requests))
    results: list[Result] = []
    errors = 0

    async def worker() -> None:
        nonlocal errors
        for i in counter:
            try:
                results.append(await one(i))
            except Exception as exc:
                errors += 1
                if errors <= 3:
                    print(f"  request {i} failed: {type(exc).__name__}: {exc}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return RunResult(results, time.perf_counter() - start, errors)


# ----------------------------------------------------------------------------------- direct (HTTP)


def direct_session(limit: int) -> aiohttp.ClientSession:
    """One session for the run, sized for every stream in flight (aiohttp's default caps at 100)."""
    connector = aiohttp.TCPConnector(limit=limit + 16, limit_per_host=0, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


#: The model name the simulated engines serve (`python -m rollout_grpc.sim`).
SIM_MODEL = "sim-llama"


def direct_body(
    token_ids: list[int], max_tokens: int, request_id: str, model: str = SIM_MODEL, stream_interval: int = 1
) -> bytes:
    """The `/inference/v1/generate` body vime's streaming rollout sends (tokens mode).

    `model` must be one the engine serves: vLLM answers 404 for any other name. `stream_interval`
    > 1 asks for that many tokens per SSE event, as the service does (bench/floor.py's HTTP floor).
    """
    sampling: dict[str, object] = {
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "logprobs": 1,
    }
    if stream_interval > 1:
        sampling["stream_interval"] = stream_interval
    return orjson.dumps(
        {
            "request_id": request_id,
            "token_ids": token_ids,
            "model": model,
            "sampling_params": sampling,
            "stream": True,
        }
    )


async def direct_generate(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    on_first_token: Callable[[], None] | None = None,
    on_event: Callable[[int], None] | None = None,
) -> Result:
    """One streamed generation straight from an engine; accumulates tokens and logprobs.

    `on_event(n)` is told the token count of every SSE event that carries tokens (bench/real_vllm.py
    reports tokens per event)."""
    start = time.perf_counter()
    ttft: float | None = None
    tokens: list[int] = []
    logprobs: list[float] = []
    finish = "none"
    async with session.post(
        url + "/inference/v1/generate", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        async for line in resp.content:
            if not line.startswith(_DATA):
                continue
            data = line[6:].strip()
            if data == _DONE:
                break
            chunk = orjson.loads(data)
            choices = chunk.get("choices")
            if not choices:
                continue
            choice = choices[0]
            ids = choice.get("token_ids")
            if ids:
                if ttft is None:
                    ttft = time.perf_counter() - start
                    if on_first_token is not None:
                        on_first_token()
                if on_event is not None:
                    on_event(len(ids))
                tokens += ids
                logprobs += [entry["logprob"] for entry in choice["logprobs"]["content"]]
            if choice.get("finish_reason") is not None:
                finish = str(choice["finish_reason"])
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
    return Result(time.perf_counter() - start, ttft, len(tokens), finish)


async def served_model(url: str) -> str:
    """The first model an engine lists at `GET /v1/models` (what a direct request must name)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        listed = (await resp.json())["data"]
    if not listed:
        raise RuntimeError(f"{url} serves no model")
    return str(listed[0]["id"])


async def run_direct(
    engines: list[str],
    concurrency: int,
    requests: int,
    max_tokens: int,
    seed: int,
    model: str = SIM_MODEL,
    stream_interval: int = 1,
) -> RunResult:
    """The workload posted straight to the engines, round-robin."""
    rng = random.Random(seed)
    bodies = [
        direct_body(prompt(rng), max_tokens, f"bench-d{seed}-{i}", model, stream_interval)
        for i in range(requests)
    ]
    async with direct_session(concurrency) as session:
        return await closed_loop(
            concurrency, requests, lambda i: direct_generate(session, engines[i % len(engines)], bodies[i])
        )


# ----------------------------------------------------------------------------------- through gRPC


def grpc_request_parts(
    token_ids: list[int], max_tokens: int, final_only: bool = False
) -> tuple[pb.Sample, pb.SamplingParams, pb.GenerateOptions]:
    """The same request as `direct_body`, as rollout.v1 messages."""
    sample = pb.Sample(tokens=token_ids, status=pb.SAMPLE_STATUS_PENDING)
    params = pb.SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    options = pb.GenerateOptions(skip_text=True, final_only=final_only)
    return sample, params, options


_STATUS = {v: k for k, v in pb.SampleStatus.items()}


async def grpc_generate(
    client: AsyncRolloutClient,
    parts: tuple[pb.Sample, pb.SamplingParams, pb.GenerateOptions],
    request_id: str,
    on_first_token: Callable[[], None] | None = None,
) -> Result:
    """One streamed generation through the service: token deltas, then the final sample."""
    start = time.perf_counter()
    ttft: float | None = None
    final: pb.Sample | None = None
    streamed = 0
    messages = 0
    async for message in client.generate_stream(*parts, request_id=request_id):
        messages += 1
        if message.HasField("delta"):
            n = len(message.delta.token_ids)
            if n and ttft is None:
                ttft = time.perf_counter() - start
                if on_first_token is not None:
                    on_first_token()
            streamed += n
        else:
            final = message.sample
    if final is None:
        raise RuntimeError("the stream ended without a sample")
    if ttft is None and final.response_length:  # final_only: the sample is the first token message
        ttft = time.perf_counter() - start
    if len(final.rollout_log_probs) != final.response_length:
        raise RuntimeError("logprobs do not match tokens")
    return Result(time.perf_counter() - start, ttft, final.response_length, _STATUS[final.status], messages)


async def run_grpc(
    target: str, concurrency: int, requests: int, max_tokens: int, seed: int, final_only: bool = False
) -> RunResult:
    """The workload through a service replica (or a proxy in front of replicas), one channel."""
    rng = random.Random(seed)
    parts = [grpc_request_parts(prompt(rng), max_tokens, final_only) for _ in range(requests)]
    async with AsyncRolloutClient(target) as client:
        return await closed_loop(
            concurrency, requests, lambda i: grpc_generate(client, parts[i], f"bench-g{seed}-{i}")
        )


# ----------------------------------------------------------------------------------- abort-all


@dataclass(slots=True)
class AbortResult:
    """Abort-all with `in_flight` generations: times from the abort call (seconds)."""

    in_flight: int
    call_s: float  # until the Abort RPC (or the pause+resume calls) returned
    last_delivery_s: float  # until the last generation ended with an aborted sample
    p50_delivery_s: float
    aborted: int
    other: int


async def _wait_started(started: asyncio.Event, tasks: list[asyncio.Task[Any]], timeout: float) -> None:
    try:
        await asyncio.wait_for(started.wait(), timeout)
    except TimeoutError:
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        detail = f"; first error: {failed[0].exception()!r}" if failed else ""
        raise RuntimeError(f"generations did not all start within {timeout}s{detail}") from None


async def abort_grpc(
    target: str, in_flight: int, max_tokens: int, seed: int, connections: int = 1
) -> AbortResult:
    """Start `in_flight` generations through the service over `connections` channels (with
    `serve --workers N`, each connection is served by one worker), wait for a token on each,
    Abort(all)."""
    rng = random.Random(seed)
    count = 0
    started = asyncio.Event()
    done_at: list[float] = []

    def first_token() -> None:
        nonlocal count
        count += 1
        if count == in_flight:
            started.set()

    async with AsyncRolloutClient(target, connections=connections) as client:

        async def one(i: int) -> Result:
            # Default batching: the first delta (a generation is in flight) comes with the second
            # token. One message per token would measure the service saturated by 1024 streams.
            parts = grpc_request_parts(prompt(rng), max_tokens)
            result = await grpc_generate(client, parts, f"bench-a{seed}-{i}", first_token)
            done_at.append(time.perf_counter())
            return result

        tasks = [asyncio.create_task(one(i)) for i in range(in_flight)]
        try:
            await _wait_started(started, tasks, 60.0)
            t0 = time.perf_counter()
            await client.abort(all=True, timeout=60.0)
            call = time.perf_counter() - t0
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
        finally:
            for task in tasks:
                task.cancel()
    return abort_result(in_flight, t0, call, done_at, [r.finish for r in results], "SAMPLE_STATUS_ABORTED")


async def abort_direct(engines: list[str], in_flight: int, max_tokens: int, seed: int) -> AbortResult:
    """The same abort done by hand, as vime does: `/pause?mode=abort` on every engine, then `/resume`."""
    rng = random.Random(seed)
    count = 0
    started = asyncio.Event()
    done_at: list[float] = []

    def first_token() -> None:
        nonlocal count
        count += 1
        if count == in_flight:
            started.set()

    async with direct_session(in_flight) as session:

        async def one(i: int) -> Result:
            body = direct_body(prompt(rng), max_tokens, f"bench-ad{seed}-{i}")
            result = await direct_generate(session, engines[i % len(engines)], body, first_token)
            done_at.append(time.perf_counter())
            return result

        async def control(url: str, path: str) -> None:
            async with session.post(url + path, json={}) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url}{path}: HTTP {resp.status}")

        tasks = [asyncio.create_task(one(i)) for i in range(in_flight)]
        try:
            await _wait_started(started, tasks, 60.0)
            t0 = time.perf_counter()
            try:
                await asyncio.gather(*(control(u, "/pause?mode=abort") for u in engines))
            finally:
                await asyncio.gather(*(control(u, "/resume") for u in engines))
            call = time.perf_counter() - t0
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
        finally:
            for task in tasks:
                task.cancel()
    return abort_result(in_flight, t0, call, done_at, [r.finish for r in results], "abort")


def abort_result(
    in_flight: int, t0: float, call: float, done_at: list[float], finishes: list[str], aborted_name: str
) -> AbortResult:
    delays = sorted(t - t0 for t in done_at)
    aborted = sum(1 for f in finishes if f == aborted_name)
    return AbortResult(
        in_flight=in_flight,
        call_s=call,
        last_delivery_s=delays[-1],
        p50_delivery_s=delays[len(delays) // 2],
        aborted=aborted,
        other=len(finishes) - aborted,
    )
