"""Render with images, generate with ``features`` / ``content_parts``, against ``r_vl.json``."""

from __future__ import annotations

import base64
import hashlib
import io
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from PIL import Image

from rollout_grpc.sim import SimEngine
from rollout_grpc.sim.multimodal import smart_resize
from rollout_grpc.sim.vocab import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from tests.support.conformance import assert_same_shape
from tests.support.sim_http import EngineFactory, generate, golden, post

VL = golden("r_vl")["mm"]
VL_CFG = {"model": "tiny-qwen2vl", "max_model_len": 1024, "multimodal": True, "eos_probability": 0.0}


def png(w: int = 56, h: int = 56, color: tuple[int, int, int] = (200, 30, 30), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def chat(raw: bytes, **extra: Any) -> dict[str, Any]:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(raw)}},
        {"type": "text", "text": "What is this?"},
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **extra}


async def render(session: aiohttp.ClientSession, eng: SimEngine, body: dict[str, Any]) -> Any:
    r = await post(session, eng.url + "/v1/chat/completions/render", body)
    return r


@pytest.fixture
async def vl(make_engine: EngineFactory) -> Any:
    async with make_engine(**VL_CFG) as eng:
        yield eng


async def test_render_image_matches_recording(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    raw = png()
    r = await render(session, vl, chat(raw))
    assert r.status == 200
    body = r.json
    rec = VL["chat_render_image"]["body"]
    assert_same_shape(rec, body)
    assert body["sampling_params"] == rec["sampling_params"]
    ids = body["token_ids"]
    f = body["features"]
    assert f["mm_hashes"] == {"image": [hashlib.sha256(raw).hexdigest()]}
    off = ids.index(IMAGE_PAD_ID)
    assert f["mm_placeholders"] == {"image": [{"offset": off, "length": 4}]}
    assert ids[off - 1] == VISION_START_ID and ids[off + 4] == VISION_END_ID
    assert ids[off : off + 4] == [IMAGE_PAD_ID] * 4
    assert isinstance(f["kwargs_data"]["image"][0], str) and isinstance(f["mm_metadata"]["image"][0], str)
    text = (await post(session, vl.url + "/detokenize", {"tokens": ids})).json["prompt"]
    assert text == (
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


async def test_render_then_generate_with_features(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    rendered = (await render(session, vl, chat(png()))).json
    r = await generate(session, vl.url, {**rendered, "return_token_ids": True})
    assert r.status == 200
    rec = VL["generate_with_features"]["body"]
    assert_same_shape(rec, r.json)
    assert r.json["prompt_token_ids"] == rendered["token_ids"]
    assert r.json["mm_placeholders"] == rendered["features"]["mm_placeholders"]
    assert r.json["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    # without return_token_ids neither is echoed
    plain = (await generate(session, vl.url, rendered)).json
    assert plain["prompt_token_ids"] is None and plain["mm_placeholders"] is None
    assert plain["choices"][0]["token_ids"] == r.json["choices"][0]["token_ids"]


async def test_features_resolved_from_cache_then_500(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    rendered = (await render(session, vl, chat(png()))).json
    want = (await generate(session, vl.url, rendered)).json["choices"][0]["token_ids"]
    features = {**rendered["features"], "kwargs_data": {"image": [None]}, "mm_metadata": None}
    body = {**rendered, "request_id": "mm-meta-only", "features": features}
    r = await generate(session, vl.url, body)
    assert r.status == 200
    assert r.json["choices"][0]["token_ids"] == want
    no_kwargs = {**rendered, "features": {**features, "kwargs_data": None}}
    assert (await generate(session, vl.url, no_kwargs)).status == 200
    assert (await post(session, vl.url + "/reset_mm_cache")).raw == b""
    r = await generate(session, vl.url, body)
    assert r.status == 500
    assert r.json == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }


async def test_content_parts(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    raw = png()
    rendered = (await render(session, vl, chat(raw))).json
    via_features = (await generate(session, vl.url, rendered)).json
    ids = rendered["token_ids"]
    off = ids.index(IMAGE_PAD_ID)
    unexpanded = [*ids[:off], IMAGE_PAD_ID, *ids[off + 4 :]]
    parts = [{"type": "image_url", "url": data_url(raw), "uuid": None}]
    base = {"sampling_params": rendered["sampling_params"], "content_parts": parts, "return_token_ids": True}
    r = await generate(session, vl.url, {**base, "token_ids": unexpanded})
    assert r.status == 200
    assert r.json["prompt_token_ids"] == ids
    assert r.json["choices"][0]["token_ids"] == via_features["choices"][0]["token_ids"]
    # already-expanded ids are expanded again, as vLLM does (4 pads become 7)
    twice = (await generate(session, vl.url, {**base, "token_ids": ids})).json
    rec = VL["generate_with_content_parts_rendered_ids"]
    assert twice["usage"]["prompt_tokens"] == len(ids) + 3
    assert twice["prompt_token_ids"].count(IMAGE_PAD_ID) == 7
    assert twice["mm_placeholders"] == {"image": [{"offset": off, "length": 4}]}
    assert "'prompt_tokens': 27" in rec["body"]  # the recording: 24 ids became 27


async def test_mm_payload_none(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    r = await render(session, vl, chat(png(), mm_payload="none"))
    rec = VL["chat_render_mm_payload_none"]["body"]
    assert_same_shape(rec, r.json)
    assert r.json["features"]["kwargs_data"] is None and r.json["features"]["mm_metadata"] is None


def _features(rendered: dict[str, Any], **change: Any) -> dict[str, Any]:
    return {**rendered, "features": {**rendered["features"], **change}}


async def test_feature_validation(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    rendered = (await render(session, vl, chat(png()))).json
    f = rendered["features"]
    ph = f["mm_placeholders"]["image"][0]
    n = len(rendered["token_ids"])

    async def err(body: dict[str, Any]) -> dict[str, Any]:
        r = await generate(session, vl.url, body)
        assert r.status == 400, r.json
        e: dict[str, Any] = r.json["error"]
        return e

    e = await err(_features(rendered, mm_placeholders={"video": [ph]}))
    assert (e["type"], e["param"]) == ("Bad Request", "body.features")
    assert "mm_hashes and mm_placeholders must use the same modalities" in e["message"]
    e = await err(_features(rendered, mm_hashes={"image": [*f["mm_hashes"]["image"], "x"]}))
    assert "image mm_hashes and mm_placeholders must have the same length" in e["message"]
    two = [ph, {"offset": ph["offset"] + 1, "length": 2}]
    e = await err(
        _features(
            rendered,
            mm_hashes={"image": ["a", "b"]},
            mm_placeholders={"image": two},
            kwargs_data=None,
            mm_metadata=None,
        )
    )
    assert "mm_placeholders must be globally non-overlapping and sorted" in e["message"]
    e = await err(_features(rendered, mm_placeholders={"image": [{"offset": n - 2, "length": 4}]}))
    # GenerateRequest._validate_multimodal_feature_bounds: a model validator, so pydantic's envelope
    assert (e["type"], e["param"]) == ("Bad Request", "body")
    assert e["message"].startswith("1 validation error:\n  {'type': 'value_error', 'loc': 'body', ")
    assert "'msg': 'Value error, mm_placeholders must remain within the token_ids sequence'" in e["message"]
    e = await err(_features(rendered, mm_placeholders={"image": [{"offset": ph["offset"], "length": 0}]}))
    assert e["param"] == "body.features.mm_placeholders.image.0.length"
    assert vl.stats.generate_started == 0


async def test_feature_consistency_as_observed(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    """Observed on vLLM 0.32 (tiny Qwen2-VL): ranges off the pad tokens are accepted; a range whose
    length disagrees with the item fails during generation (500); undecodable kwargs crash the
    handler (plain-text 500, connection closed)."""
    rendered = (await render(session, vl, chat(png()))).json
    ph = rendered["features"]["mm_placeholders"]["image"][0]
    r = await generate(
        session, vl.url, _features(rendered, mm_placeholders={"image": [{"offset": 0, "length": 4}]})
    )
    assert r.status == 200
    r = await generate(
        session,
        vl.url,
        _features(rendered, mm_placeholders={"image": [{"offset": ph["offset"], "length": 3}]}),
    )
    assert (r.status, r.json["error"]["message"]) == (500, "Internal server error")
    garbage = _features(rendered, kwargs_data={"image": ["bm90IG1zZ3BhY2s="]}, mm_metadata=None)
    async with aiohttp.ClientSession() as fresh:
        r = await generate(fresh, vl.url, garbage)
    assert (r.status, r.raw, r.content_type) == (500, b"Internal Server Error", "text/plain; charset=utf-8")


async def test_bad_images_and_limits(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    body = chat(png())
    body["messages"][0]["content"][0]["image_url"]["url"] = data_url(b"not an image at all")
    r = await render(session, vl, body)
    assert r.status == 400 and r.json["error"]["type"] == "BadRequestError"
    three = chat(png())
    three["messages"][0]["content"] = [three["messages"][0]["content"][0]] * 3
    r = await render(session, vl, three)
    assert r.status == 400 and "At most 2 image(s)" in r.json["error"]["message"]
    jpeg = chat(png(fmt="JPEG"))
    jpeg["messages"][0]["content"][0]["image_url"]["url"] = data_url(png(fmt="JPEG"), "image/jpeg")
    assert (await render(session, vl, jpeg)).status == 200


async def test_images_change_the_output(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    a = (await render(session, vl, chat(png(color=(255, 0, 0))))).json
    b = (await render(session, vl, chat(png(color=(0, 0, 255))))).json
    assert a["token_ids"] == b["token_ids"]
    ta = (
        await generate(session, vl.url, {**a, "sampling_params": {"max_tokens": 12, "temperature": 0}})
    ).json
    tb = (
        await generate(session, vl.url, {**b, "sampling_params": {"max_tokens": 12, "temperature": 0}})
    ).json
    assert ta["choices"][0]["token_ids"] != tb["choices"][0]["token_ids"]


async def test_text_only_engine_rejects_media(engine: SimEngine, session: aiohttp.ClientSession) -> None:
    r = await render(session, engine, chat(png()))
    assert r.status == 400
    ids = [1, 4, IMAGE_PAD_ID, IMAGE_PAD_ID, IMAGE_PAD_ID, IMAGE_PAD_ID, 5, 2]
    feats = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 2, "length": 4}]}}
    r = await generate(
        session, engine.url, {"token_ids": ids, "features": feats, "sampling_params": {"max_tokens": 1}}
    )
    assert r.status == 400
    assert r.json["error"] == {  # observed on vLLM 0.32 (tiny-llama)
        "message": "The decoder prompt contains a(n) image item with 4 embedding tokens, which exceeds the "
        "pre-allocated encoder cache size 0. Please reduce the input size or increase the encoder cache "
        "size by setting --limit-mm-per-prompt at startup.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


@pytest.mark.parametrize(
    ("w", "h", "tokens"),
    [(56, 56, 4), (28, 28, 4), (84, 56, 6), (280, 280, 16), (112, 112, 16), (300, 300, 9)],
)
def test_placeholder_sizes(w: int, h: int, tokens: int) -> None:
    rh, rw = smart_resize(h, w, 4 * 28 * 28, 16 * 28 * 28)
    assert (rh // 28) * (rw // 28) == tokens


async def test_pause_with_clear_cache_drops_mm_cache(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    rendered = (await render(session, vl, chat(png()))).json
    cached = {**rendered, "features": {**rendered["features"], "kwargs_data": None, "mm_metadata": None}}
    assert (await generate(session, vl.url, cached)).status == 500  # a render caches nothing
    assert (await generate(session, vl.url, rendered)).status == 200  # a generate with kwargs does
    await post(session, vl.url + "/pause?mode=keep&clear_cache=false")
    await post(session, vl.url + "/resume")
    assert (await generate(session, vl.url, cached)).status == 200
    await post(session, vl.url + "/pause?mode=abort")  # clear_cache defaults to true
    await post(session, vl.url + "/resume")
    assert (await generate(session, vl.url, cached)).status == 500
    assert (await generate(session, vl.url, rendered)).status == 200  # kwargs_data re-populates the cache
    assert (await generate(session, vl.url, cached)).status == 200


async def test_observed_error_messages(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    """Bodies recorded from vLLM 0.32 (tiny Qwen2-VL, --max-model-len 1024, two images per prompt)."""
    body = chat(png())
    body["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": data_url(b"not an image")}}]
    r = await render(session, vl, body)
    assert (r.status, r.json["error"]) == (
        400,
        {
            "message": "Failed to load image: cannot identify image file <_io.BytesIO object>",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
    )
    three = chat(png())
    three["messages"][0]["content"] = [three["messages"][0]["content"][0]] * 3
    r = await render(session, vl, three)
    assert r.json["error"] == {
        "message": "At most 2 image(s) may be provided in one prompt. (parameter=image)",
        "type": "BadRequestError",
        "param": "image",
        "code": 400,
    }
    r = await post(session, vl.url + "/v1/completions/render", {"prompt": [5] * 1100})
    assert r.json["error"] == {
        "message": "This model's maximum context length is 1024 tokens. However, your prompt contains 1100 "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
        "of the input prompt. (parameter=input_tokens, value=1100)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
    r = await generate(session, vl.url, {"token_ids": [5] * 1100, "sampling_params": {"max_tokens": 1}})
    assert r.json["error"]["message"].endswith(
        "For image inputs, the number of image tokens depends on the number of images, and possibly their "
        "aspect ratios as well."
    )
    parts = [{"type": "image_url", "url": data_url(png())}]
    r = await generate(
        session, vl.url, {"token_ids": [1, 2, 3], "content_parts": parts, "sampling_params": {}}
    )
    assert (r.status, r.json["error"]["message"]) == (
        500,
        "Failed to apply prompt replacement for mm_items['image'][0]",
    )
    parts = [{"type": "image_url", "url": "http://127.0.0.1:1/x.png"}]
    r = await generate(
        session, vl.url, {"token_ids": [1, 4, 6, 5, 2], "content_parts": parts, "sampling_params": {}}
    )
    assert (r.status, r.json["error"]) == (
        500,
        {
            "message": "Cannot connect to host 127.0.0.1:1 ssl:default "
            "[Connect call failed ('127.0.0.1', 1)]",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        },
    )


async def test_http_image_urls(vl: SimEngine, session: aiohttp.ClientSession) -> None:
    """Media URLs are fetched like vLLM's MediaConnector does (here from a local server)."""
    raw = png(84, 56)
    app = web.Application()

    async def image(_: web.Request) -> web.Response:
        return web.Response(body=raw, content_type="image/png")

    app.router.add_get("/img.png", image)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}/img.png"
        body = chat(raw)
        body["messages"][0]["content"][0]["image_url"]["url"] = url
        r = await render(session, vl, body)
        assert r.status == 200
        assert r.json["features"]["mm_hashes"] == {"image": [hashlib.sha256(raw).hexdigest()]}
        assert r.json["features"]["mm_placeholders"]["image"][0]["length"] == 6
        ids = [1, 4, IMAGE_PAD_ID, 5, 2]
        g = await generate(
            session,
            vl.url,
            {"token_ids": ids, "content_parts": [{"type": "image_url", "url": url}], "return_token_ids": True,
             "sampling_params": {"max_tokens": 2}},
        )  # fmt: skip
        assert g.status == 200 and g.json["prompt_token_ids"].count(IMAGE_PAD_ID) == 6
    finally:
        await runner.cleanup()
