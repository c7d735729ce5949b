"""Edges of the request surface (issue 12 item 8, issue 14 item 4, issue 16 item 4).

Request ids follow one rule checked before anything is generated; an abort of an unknown id only
touches that id's own engine calls; undecodable request bytes and decompression bombs are the
caller's INVALID_ARGUMENT; images decode off the event loop; an engines reload resizes admission;
the breaker cooldown is the configured one.
"""

from __future__ import annotations

import asyncio
import io
import struct
import threading
import types
import zlib

import grpc
import pytest
from PIL import Image

from rollout_grpc.client import image_part, make_sample, pb
from rollout_grpc.server.app import RolloutServer, ServerConfig
from tests.harness import harness, running_server, sim_engines
from tests.support.service import field_violation

PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301]
GENERATE = "/rollout.v1.RolloutService/Generate"


# ------------------------------------------------------------------------------------ request ids


@pytest.mark.parametrize("request_id", ["café", "a\tb", "a\nb", "🙂", "x~1", "x" * 257, "a b"])
async def test_bad_request_ids_are_refused_before_generating(request_id: str) -> None:
    async with harness("sim") as h:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4}, request_id=request_id)
        assert field_violation(refused.value) == "request_id"
        assert h.sims[0].stats.generate_started == 0


async def test_every_allowed_character_is_accepted() -> None:
    async with harness("sim") as h:
        sample = await h.client.generate(
            make_sample(PROMPT), {"max_new_tokens": 2}, request_id="Az09._:/@+=-" + "x" * 244
        )
        assert sample.response_length == 2


async def test_aborting_an_unknown_id_leaves_another_callers_failover_lookalike_alone() -> None:
    async with harness("sim", sim_config={"token_delay_s": 0.005, "eos_probability": 0.0}) as h:
        params = {"max_new_tokens": 200, "ignore_eos": True}
        stream = h.client.generate_stream(make_sample(PROMPT), params, request_id="job.1")
        first = await anext(stream)
        assert first.HasField("delta")
        response = await h.client.abort(request_ids=["job"])
        assert list(response.unknown_request_ids) == ["job"] and response.aborted == 0
        final = None
        async for message in stream:
            if message.HasField("sample"):
                final = message.sample
        assert final is not None
        assert final.status == pb.SAMPLE_STATUS_TRUNCATED, pb.SampleStatus.Name(final.status)
        assert final.response_length == 200


# ------------------------------------------------------------------------------------ undecodable


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _deeply_nested_request(depth: int) -> bytes:
    """A GenerateRequest whose `sample.metadata` Struct nests `depth` levels (built by hand:
    protobuf itself refuses to build what it cannot parse)."""
    struct = b""
    for _ in range(depth):
        value = _len_field(5, struct)  # Value.struct_value
        entry = _len_field(1, b"k") + _len_field(2, value)  # map entry: key, value
        struct = _len_field(1, entry)  # Struct.fields
    sample = pb.Sample(tokens=PROMPT).SerializeToString() + _len_field(16, struct)
    return _len_field(1, sample)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(_deeply_nested_request(150), id="metadata-beyond-recursion-limit"),
        pytest.param(
            pb.GenerateRequest(request_id="AAAA").SerializeToString().replace(b"AAAA", b"\xff\xfe\xff\xfe"),
            id="invalid-utf8",
        ),
        pytest.param(b"\x0a\xff\xff\xff", id="truncated"),
    ],
)
async def test_undecodable_requests_are_invalid_argument(raw: bytes) -> None:
    async with harness("sim") as h, grpc.aio.insecure_channel(h.target) as channel:
        method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(GENERATE)
        call = method(raw, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
        assert field_violation(refused.value) == "request"
        details = refused.value.details() or ""
        assert "GenerateRequest" in details and "<class" not in details


# ------------------------------------------------------------------------------------ images


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` grey pixels (a decompression bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


async def test_a_decompression_bomb_is_refused_unopened() -> None:
    async with harness("sim", sim_config={"multimodal": True}) as h:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await h.client.render([{"role": "user", "content": [image_part(_png_header_only(30000, 30000))]}])
        assert field_violation(refused.value) == "chat.messages[0].content[0].image.data"


async def test_image_limits_in_pixels_and_bytes_are_the_configured_ones() -> None:
    async with harness(
        "sim", sim_config={"multimodal": True}, max_image_pixels=56 * 56, max_image_bytes=4096
    ) as h:
        ok = await h.client.render([{"role": "user", "content": [image_part(_png(56, 56)), "hi"]}])
        assert ok.token_ids
        for image in (_png(57, 56), b"\x89PNG" + b"\0" * 5000):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await h.client.render([{"role": "user", "content": [image_part(image)]}])
            assert field_violation(refused.value) == "chat.messages[0].content[0].image.data"
            assert "limit" in (refused.value.details() or "")


async def test_images_are_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica's image checks run in a worker thread (the in-process simulator decodes too,
    on its own: only the replica's module is watched)."""
    from rollout_grpc.server.rollout import render

    loop_thread = threading.get_ident()
    opened_on: list[int] = []

    def recording_open(*args: object, **kwargs: object) -> object:
        opened_on.append(threading.get_ident())
        return Image.open(*args, **kwargs)  # type: ignore[arg-type]

    watched = types.SimpleNamespace(open=recording_open, DecompressionBombError=Image.DecompressionBombError)
    monkeypatch.setattr(render, "Image", watched)
    async with harness("sim", sim_config={"multimodal": True}) as h:
        await h.client.render([{"role": "user", "content": [image_part(_png(56, 56)), "hi"]}])
    assert opened_on and loop_thread not in opened_on


# ------------------------------------------------------------------------------------ engines reload


async def test_an_engines_reload_resizes_admission() -> None:
    async with sim_engines(3) as sims, running_server([sims[0].url], server_concurrency=4) as server:
        assert server.rollout.admission.limit == 4
        server.reload_engines([s.url for s in sims])
        assert server.rollout.admission.limit == 12
        assert [e.url for e in server.pool.engines] == [s.url for s in sims]
        server.reload_engines([sims[2].url])
        assert server.rollout.admission.limit == 4


async def test_the_breaker_cooldown_is_the_configured_one() -> None:
    async with sim_engines(1) as sims:
        server = RolloutServer(
            ServerConfig(
                engines=[sims[0].url],
                port=0,
                health_port=None,
                health_interval_s=0.05,
                breaker_cooldown_s=0.0,
            )
        )
        await server.start()
        try:
            engine = server.pool.engines[0]
            back = asyncio.Event()
            server.pool.add_listener(
                lambda usable: back.set() if usable and engine.healthy is not False else None
            )
            server.pool.report_failure(engine, "broken stream")
            assert not engine.healthy
            back.clear()
            # With no cooldown the next successful probe takes it back (the default waits 5 s).
            await asyncio.wait_for(back.wait(), 2.0)
            assert engine.healthy
        finally:
            await server.stop(grace_s=0)


async def test_an_engines_reload_replaces_the_kind_table_and_never_edits_the_callers() -> None:
    """The reload used to clear and refill `ServerConfig.engine_kinds` in place: a table the caller
    kept (or shared with another replica's config) changed under it."""
    async with (
        sim_engines(1) as (vllm,),
        sim_engines(1, kind="sglang") as (sglang,),
    ):
        given = {sglang.url: "sglang"}
        async with running_server([vllm.url, sglang.url], engine_kinds=given) as server:
            server.reload_engines([vllm.url])
            assert given == {sglang.url: "sglang"}, "the caller's table was edited"
            assert server.config.engine_kinds == {}
            server.reload_engines([vllm.url, sglang.url], {sglang.url: "sglang"})
            joined = server.pool.get(sglang.url)
            assert joined is not None and joined.client.kind == "sglang"
