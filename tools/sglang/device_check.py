"""Runs issue 39's SGLang scenario checks through a real rollout-grpc replica against one SGLang engine.

`device_check.sh` starts SGLang 0.5.23 on a GPU and calls this with `--engine-url`; the normal test
suite calls it against the SGLang simulator started as a real server
(tests/integration/test_sglang_device_check.py), so every check here runs on each CI pass. Each
check is `passed`, `failed` or `skipped` with a detail; the JSON summary (`--out`) is::

    {"engine_url": str, "passed": bool, "checks": [{"name": str, "status": str, "detail": str}, ...]}

and the exit code is 1 when any check failed (0 otherwise). The checks (issue 39's five behaviours,
then the control paths a trainer uses):

* `capabilities`: the replica sees the engine as SGLang, usable, and reports its warnings;
* `logprob_definition`: the logprob definition the adapter reports (SGLang: temperature-scaled);
* `seed_honoured`: two calls with one seed give the same tokens, two seeds differ (SGLang ignores
  `sampling_seed` without `--enable-deterministic-inference`; the replica then refuses seeded calls);
* `abort_all_continue`: Abort(all) ends every running call ABORTED with its tokens; each continues
  to exactly its budget, its tokens kept;
* `abort_all_over_paused`: a `keep` pause (SGLang `in_place`) then Abort(all) answers within
  `--hang-s` (0.5.23 wedges on an abort pause over in_place unless the adapter continues first);
* `queued_abort_echo`: a call aborted while the engine is paused `retract` (back in the waiting
  queue) ends ABORTED with every token it had;
* `pause_continue_versions`: a `keep` pause, resume under a new version: the kept calls' spans are
  old -> new;
* `multimodal_ids`: skipped, with the reason (`MULTIMODAL_SKIPPED`): only a text model is served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.server.config import ServerConfig

PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]
LONG: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True}


#: Why the multimodal check does not run: it would need a second SGLang serving tiny-qwen2vl (built,
#: not served) and that processor's placeholder expansion for a test image, neither set up here.
MULTIMODAL_SKIPPED = (
    "only tiny-llama is served; a multimodal ids check needs a second SGLang on tiny-qwen2vl "
    "(built, not started) and its processor's placeholder expansion, not set up in this check"
)


class CheckFailed(Exception):
    """A check's expectation did not hold; the message is the summary's detail."""


@dataclass
class Check:
    name: str
    status: str
    detail: str


def expect(condition: bool, detail: str) -> None:
    if not condition:
        raise CheckFailed(detail)


class Stream:
    """A streaming Generate in the background; `first` is set once it streamed `ready_at` tokens."""

    def __init__(
        self, client: AsyncRolloutClient, request_id: str, params: dict[str, object], ready_at: int = 1
    ) -> None:
        self.first = asyncio.Event()
        self.ready_at = ready_at
        self.tokens: list[int] = []
        self.task = asyncio.ensure_future(self._run(client, request_id, params))

    async def _run(self, client: AsyncRolloutClient, request_id: str, params: dict[str, object]) -> pb.Sample:
        sample = make_sample(PROMPT)
        async for message in client.generate_stream(sample, params, request_id=request_id, timeout=300):
            if message.WhichOneof("event") == "delta":
                self.tokens.extend(message.delta.token_ids)
                if len(self.tokens) >= self.ready_at:
                    self.first.set()
            else:
                return message.sample
        raise CheckFailed(f"{request_id}: the stream ended without a sample")


async def started(streams: list[Stream], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        await asyncio.gather(*(s.first.wait() for s in streams))


class Checks:
    def __init__(self, client: AsyncRolloutClient, url: str, hang_s: float) -> None:
        self.client, self.url, self.hang_s = client, url, hang_s

    async def capabilities(self) -> str:
        info = await self.client.get_server_info()
        [engine] = info.engines
        expect(engine.kind == "sglang", f"the replica sees kind {engine.kind!r}")
        expect(engine.usable, f"engine not usable: {list(engine.problems)} {engine.health_error}")
        return f"version {info.weight_version!r}; warnings: {list(engine.warnings)}"

    async def logprob_definition(self) -> str:
        info = await self.client.get_server_info()
        mode = info.engines[0].capabilities.logprobs_mode
        expect(bool(mode), "no logprob definition reported")
        return mode

    async def seed_honoured(self) -> str:
        params = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
        try:
            a, b, c = [
                await self.client.generate(make_sample(PROMPT), {**params, "seed": seed})
                for seed in (7, 7, 8)
            ]
        except Exception as exc:
            raise CheckFailed(f"seeded call refused: {exc}") from exc
        expect(list(a.tokens) == list(b.tokens), "one seed gave two different sequences")
        expect(list(a.tokens) != list(c.tokens), "two seeds gave the same sequence")
        return "seed 7 twice: same tokens; seed 8: different"

    async def abort_all_continue(self) -> str:
        streams = [Stream(self.client, f"dc-all-{i}", LONG) for i in range(4)]
        await started(streams, self.hang_s)
        async with asyncio.timeout(self.hang_s):
            response = await self.client.abort(all=True)
            samples = await asyncio.gather(*(s.task for s in streams))
        expect(not response.engine_errors, f"engine errors: {list(response.engine_errors)}")
        for stream, sample in zip(streams, samples, strict=True):
            expect(sample.status == pb.SAMPLE_STATUS_ABORTED, f"status {sample.status}")
            expect(list(sample.tokens[len(PROMPT) :]) == stream.tokens, "streamed tokens differ")
        lengths = []
        for sample in samples:
            done = await self.client.generate(sample, LONG, {"mask_offpolicy": True})
            expect(done.response_length == LONG["max_new_tokens"], f"continued to {done.response_length}")
            expect(list(done.tokens[: len(sample.tokens)]) == list(sample.tokens), "tokens not kept")
            lengths.append(sample.response_length)
        return f"aborted at {lengths} tokens, each continued to {LONG['max_new_tokens']}"

    async def abort_all_over_paused(self) -> str:
        streams = [Stream(self.client, f"dc-paused-{i}", LONG) for i in range(2)]
        await started(streams, self.hang_s)
        await self.client.pause("keep")
        began = time.monotonic()
        try:
            async with asyncio.timeout(self.hang_s):
                response = await self.client.abort(all=True)
                samples = await asyncio.gather(*(s.task for s in streams))
        except TimeoutError as exc:
            raise CheckFailed(f"Abort(all) over a keep pause did not answer in {self.hang_s} s") from exc
        expect(not response.engine_errors, f"engine errors: {list(response.engine_errors)}")
        for stream, sample in zip(streams, samples, strict=True):
            expect(sample.status == pb.SAMPLE_STATUS_ABORTED, f"status {sample.status}")
            expect(sample.response_length >= len(stream.tokens) >= 1, "tokens lost")
            # The engine's own abort chunk ended the call, not the replica's drain bound (a wedged
            # engine never sends it: `abort_drain_expired`, the tokens after the last chunk lost).
            errors = [a.error for a in sample.engine_attempts if a.error]
            expect(not errors, f"the engine did not end the call: {errors}")
        after = await self.client.generate(make_sample(PROMPT), {**LONG, "max_new_tokens": 4})
        expect(after.response_length == 4, "the engine does not generate after the abort")
        return f"answered in {time.monotonic() - began:.2f} s; the engine generates after it"

    async def queued_abort_echo(self) -> str:
        # Several tokens first: the echo's one id then differs from its count (a one-token call's
        # echo looks like a whole cumulative output and would not test the echo's handling).
        stream = Stream(self.client, "dc-queued", LONG, ready_at=4)
        await started([stream], self.hang_s)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.url}/pause_generation", json={"mode": "retract"}) as r:
                expect(r.status == 200, f"/pause_generation retract: HTTP {r.status}")
            try:
                async with asyncio.timeout(self.hang_s):
                    await self.client.abort(request_ids=["dc-queued"])
                    sample = await stream.task
            finally:
                async with http.post(f"{self.url}/continue_generation", json={}) as r:
                    expect(r.status == 200, f"/continue_generation: HTTP {r.status}")
        expect(sample.status == pb.SAMPLE_STATUS_ABORTED, f"status {sample.status}: {sample.failure_reason}")
        expect(sample.response_length >= len(stream.tokens) >= 4, "tokens lost")
        expect(list(sample.tokens[len(PROMPT) :]) == stream.tokens, "the sample is not what was streamed")
        expect(len(sample.rollout_log_probs) == sample.response_length, "a logprob per token")
        errors = [a.error for a in sample.engine_attempts if a.error]
        expect(not errors, f"the engine's abort echo did not end the call: {errors}")
        return f"ABORTED with {sample.response_length} tokens"

    async def pause_continue_versions(self) -> str:
        before = (await self.client.get_server_info()).weight_version
        streams = [Stream(self.client, f"dc-keep-{i}", {**LONG, "max_new_tokens": 200}) for i in range(2)]
        await started(streams, self.hang_s)
        await self.client.pause("keep")
        new = f"device-check-{int(time.time())}"
        await self.client.resume(weight_version=new)
        async with asyncio.timeout(self.hang_s):
            samples = await asyncio.gather(*(s.task for s in streams))
        for sample in samples:
            versions = [w.version for w in sample.weight_versions]
            expect(sample.response_length == 200, f"length {sample.response_length}")
            expect(versions == [before, new], f"versions {versions}, expected {[before, new]}")
        return f"spans {before!r} -> {new!r}"


async def run_checks(engine_url: str, hang_s: float) -> list[Check]:
    config = ServerConfig(engines=[engine_url], engine_kinds={engine_url: "sglang"}, port=0, health_port=None)
    server = RolloutServer(config)
    await server.start()
    results: list[Check] = []
    try:
        async with AsyncRolloutClient(f"127.0.0.1:{server.port}", retry=None) as client:
            checks = Checks(client, engine_url, hang_s)
            order: list[tuple[str, Callable[[], Awaitable[str]]]] = [
                ("capabilities", checks.capabilities),
                ("logprob_definition", checks.logprob_definition),
                ("seed_honoured", checks.seed_honoured),
                ("abort_all_continue", checks.abort_all_continue),
                ("abort_all_over_paused", checks.abort_all_over_paused),
                ("queued_abort_echo", checks.queued_abort_echo),
                ("pause_continue_versions", checks.pause_continue_versions),
            ]
            for name, check in order:
                try:
                    results.append(Check(name, "passed", await check()))
                except CheckFailed as exc:
                    results.append(Check(name, "failed", str(exc)))
                except Exception as exc:  # a check's crash is its failure, the others still run
                    detail = "".join(traceback.format_exception_only(exc)).strip()
                    results.append(Check(name, "failed", detail))
            results.append(Check("multimodal_ids", "skipped", MULTIMODAL_SKIPPED))
    finally:
        await server.stop(0.5)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-url", required=True, help="the SGLang engine's base URL (http://host:port)")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON summary is written")
    parser.add_argument("--hang-s", type=float, default=60.0, help="a wait longer than this is a failure")
    args = parser.parse_args(argv)
    url = args.engine_url.rstrip("/")
    checks = asyncio.run(run_checks(url, args.hang_s))
    passed = all(c.status != "failed" for c in checks)
    summary = {"engine_url": url, "passed": passed, "checks": [asdict(c) for c in checks]}
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    for c in checks:
        print(f"{c.status:7} {c.name}: {c.detail}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
