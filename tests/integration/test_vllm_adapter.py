"""The vLLM adapter against scripted HTTP engines: silence, liveness, huge lines, the media record."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web

from rollout_grpc.server.domain.model import MultimodalFeatures, MultimodalItem, SamplingParams
from rollout_grpc.server.engines.api import (
    EngineCall,
    EngineDelta,
    EngineFinal,
    EngineHung,
    EngineMalformed,
    EngineTimeouts,
    MediaCacheMiss,
)
from rollout_grpc.server.engines.vllm.adapter import VllmEngine
from rollout_grpc.sim import SimConfig, SimEngine

CALL = EngineCall("r", 0, [1, 2, 3], SamplingParams(temperature=0), 4, 0, want_text=False)


def chunk(tokens: list[int], finish: str | None = None, pad: int = 0) -> bytes:
    choice = {
        "index": 0,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": tokens,
        "routed_experts": None,
        "weight_versions": [{"version": "v", "start": 0, "end": 2}] if finish else None,
        "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in tokens]},
        "padding": "x" * pad,
    }
    return b"data: " + orjson.dumps({"request_id": "x", "choices": [choice]}) + b"\n\n"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def engine(generate: Handler, health: Handler | None = None) -> AsyncIterator[str]:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/health", health or ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def collect(adapter: VllmEngine, call: EngineCall = CALL) -> list[object]:
    return [event async for event in adapter.generate(call)]


async def test_silent_stream_of_an_unresponsive_engine_is_hung() -> None:
    """SIGSTOP-like: one token, then nothing, and /health does not answer either."""

    release = asyncio.Event()  # lets the stuck handlers end when the test is done

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(chunk([7]))
        await release.wait()
        return resp

    async def health(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response()

    async with engine(generate, health) as url, aiohttp.ClientSession() as session:
        adapter = VllmEngine(url, session, EngineTimeouts(idle=0.2, liveness=0.2))
        events: list[object] = []
        with pytest.raises(EngineHung):
            async for event in adapter.generate(CALL):
                events.append(event)
        assert events == [EngineDelta([7], [-1.0], None, "")]
        release.set()


async def test_silent_stream_of_a_live_engine_keeps_waiting() -> None:
    """A paused engine holds its requests: while /health answers, the stream is not given up."""
    probes = 0
    probed_twice = asyncio.Event()

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(chunk([7]))
        await probed_twice.wait()  # silent through two idle periods
        await resp.write(chunk([8], "length"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(_: web.Request) -> web.Response:
        nonlocal probes
        probes += 1
        if probes >= 2:
            probed_twice.set()
        return web.Response()

    async with engine(generate, health) as url, aiohttp.ClientSession() as session:
        adapter = VllmEngine(url, session, EngineTimeouts(idle=0.1))
        events = await asyncio.wait_for(collect(adapter), 10)
        assert isinstance(events[-1], EngineFinal) and probes >= 2


async def test_multi_megabyte_lines_are_read_and_bounded() -> None:
    big = 3 * 1024 * 1024

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(chunk([7], pad=big))
        await resp.write(chunk([8], "length", pad=big))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with engine(generate) as url, aiohttp.ClientSession() as session:
        events = await collect(VllmEngine(url, session))
        assert [e.token_ids for e in events if isinstance(e, EngineDelta)] == [[7], [8]]
        with pytest.raises(EngineMalformed, match="exceeds"):
            await collect(VllmEngine(url, session, EngineTimeouts(max_event_bytes=1024 * 1024)))


def features() -> MultimodalFeatures:
    return MultimodalFeatures({"image": [MultimodalItem("h", 1, 4, None, None, 9)]})


async def test_pause_forgets_the_media_the_engine_held() -> None:
    """vLLM's /pause empties its media cache: the adapter must not send those hashes alone again."""
    async with SimEngine(SimConfig(multimodal=True)) as sim, aiohttp.ClientSession() as session:
        adapter = VllmEngine(sim.url, session)
        adapter._remember_media(["h"])
        assert adapter.holds_media("h")
        await adapter.pause("keep")
        await adapter.resume()
        assert not adapter.holds_media("h")


async def test_hash_only_failure_is_a_cache_miss_and_forgets_the_hash() -> None:
    async with SimEngine(SimConfig(multimodal=True)) as sim, aiohttp.ClientSession() as session:
        adapter = VllmEngine(sim.url, session)
        adapter._remember_media(["h"])
        call = EngineCall("r", 0, [1, 9, 9, 9, 9, 3], SamplingParams(), 2, 0, features=features())
        with pytest.raises(MediaCacheMiss):
            await collect(adapter, call)
        assert not adapter.holds_media("h")


async def test_a_connection_lost_after_the_final_chunk_loses_nothing() -> None:
    """The final result arrived; a lost usage chunk or [DONE] must not make the call fail over."""

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(chunk([7]))
        await resp.write(chunk([8], "stop"))
        return resp  # no usage chunk, no [DONE]

    async with engine(generate) as url, aiohttp.ClientSession() as session:
        events = await collect(VllmEngine(url, session))
        assert isinstance(events[-1], EngineFinal) and events[-1].weight_spans[0].end == 2
