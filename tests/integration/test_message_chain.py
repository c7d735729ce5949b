"""How many generators one streamed message passes through, over real HTTP from a scripted engine.

Why: every `async for` / `yield` hop costs a generator resume per message (and, for a call that is
cancelled, a finalizer task per abandoned generator), and the service's own share of its CPU per
streamed token is spread over that chain (bench/profile_notes.md, thirteenth pass). The layers that
only forwarded items (the facade, the adapter's outer generator, the engine call's reader, the
attempt's generator) were folded into their neighbours; these tests keep them folded and check
that the events of one read of the engine's body reach the sample in one resume.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import AsyncIterator
from types import FrameType
from typing import Any, cast

import aiohttp
import orjson
from aiohttp import web

from rollout_grpc.server.domain.model import GenerateOptions, Sample, SamplingParams, Status, TokenBatch
from rollout_grpc.server.engines.api import EngineTimeouts
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.engines.vllm.adapter import VllmEngine
from rollout_grpc.server.facade.calls import CallRecord, Door
from rollout_grpc.server.facade.door import RolloutFacade
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.inflight import InFlightRegistry

#: The async generators between the engine's body and the caller of `RolloutFacade.generate`,
#: innermost first: the SSE split, the adapter, the engine call, the attempt loop, the generation.
CHAIN = [
    "HttpEngine._events",
    "VllmEngine.generate",
    "EngineCaller.stream",
    "AttemptLoop.run",
    "Rollout.generate",
]


def chunk(tokens: list[int], finish: str | None = None) -> bytes:
    choice = {
        "index": 0,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": tokens,
        "routed_experts": None,
        "weight_versions": [{"version": "v", "start": 0, "end": 6}] if finish else None,
        "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in tokens]},
    }
    return b"data: " + orjson.dumps({"request_id": "x", "choices": [choice]}) + b"\n\n"


@contextlib.asynccontextmanager
async def engine() -> AsyncIterator[str]:
    """An engine that writes its first two chunks in one write, then the rest."""

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(chunk([10, 11]) + chunk([12, 13]))
        await resp.write(chunk([14, 15], "stop") + b"data: [DONE]\n\n")
        return resp

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/health", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def async_generators(frame: FrameType | None) -> list[str]:
    """The async generators running on this stack, innermost first."""
    names = []
    while frame is not None:
        if frame.f_code.co_flags & inspect.CO_ASYNC_GENERATOR:
            names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    return names


class CountingEngine(VllmEngine):
    """A vLLM adapter that notes the generator chain at each read of the body (and what it read)."""

    chains: list[list[str]]

    async def _read(self, resp: aiohttp.ClientResponse, watch: Any) -> bytes:
        self.chains.append(async_generators(sys._getframe(1)))
        return await super()._read(resp, watch)


async def test_a_streamed_message_passes_five_generators_and_one_resume_per_read() -> None:
    async with engine() as url, aiohttp.ClientSession() as session:
        adapter = CountingEngine(url, session, EngineTimeouts())
        adapter.chains = []
        pool = EnginePool([url], lambda _: adapter)
        rollout = Rollout(pool, Admission(4, 4), InFlightRegistry())
        # The facade's generation touches neither the control plane nor the renderer.
        facade = RolloutFacade(rollout, cast(Any, None), cast(Any, None))
        record = CallRecord(Door.GRPC, "Generate")
        events = facade.generate(
            record,
            Sample(prompt_ids=(1, 2, 3)),
            SamplingParams(max_new_tokens=6),
            GenerateOptions(stream_batch_tokens=1, stream_batch_interval_s=0),
            "chain-1",
        )
        assert inspect.isasyncgen(events) and events.ag_code is Rollout.generate.__code__, (
            "the facade hands out the rollout's own generator, observed by callbacks"
        )
        items = [item async for item in events]

    assert adapter.chains, "the body was read"
    for chain in adapter.chains:
        assert chain == CHAIN
    batches = [item for item in items if isinstance(item, TokenBatch)]
    final = items[-1]
    assert isinstance(final, Sample) and final.status is Status.COMPLETED
    assert [t for b in batches for t in b.token_ids] == [10, 11, 12, 13, 14, 15]
    # The facade's observation, without a generator of its own: the sample and the first token.
    assert record.sample is final and record.request_id == "chain-1"
    assert record.ttft_s is not None


async def test_the_events_of_one_read_come_in_one_resume() -> None:
    async with engine() as url, aiohttp.ClientSession() as session:
        adapter = VllmEngine(url, session, EngineTimeouts())
        async with (
            session.post(url + "/inference/v1/generate", data=b"{}") as resp,
            contextlib.aclosing(adapter._events(resp)) as batches,
        ):
            got = [batch async for batch in batches]
    payloads = [p for batch in got for p in batch]
    assert len(payloads) == 4 and payloads[-1] == b"[DONE]"
    # The first write's two events arrive in one read (loopback, one write): one list, one resume.
    assert len(got) < len(payloads)
    assert all(batch for batch in got), "never an empty list"
