"""Multimodal: Render with images, generate with features, continuation, realignment, bad images."""

from __future__ import annotations

import base64

import aiohttp
import grpc
import pytest

from rollout_grpc.client import image_part, make_sample, pb
from rollout_grpc.sim.config import SGLangOptions
from tests.harness import Harness, harness
from tests.support.multimodal import chat, png, sample_from, vl
from tests.support.service import PROMPT, assert_lossless, field_violation, start_stream, started


@pytest.mark.vllm_server("vl")
async def test_render_then_generate(backend: str, request: pytest.FixtureRequest) -> None:
    async with vl(backend, request) as h:
        rendered = await h.client.render(chat(png()), session_id="vl-1")
        (modality,) = rendered.features.modalities
        assert modality.modality == "image"
        (item,) = modality.items
        pad = item.placeholder_token_id
        placeholder = list(
            rendered.token_ids[item.placeholder.offset : item.placeholder.offset + item.placeholder.length]
        )
        assert placeholder == [pad] * item.placeholder.length and item.placeholder.length > 1
        assert len(item.mm_hash) == 64 and item.HasField("kwargs_data")
        sample = await h.client.generate(
            sample_from(rendered, "vl-1"), {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
        )
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 6
        assert list(sample.tokens[: len(rendered.token_ids)]) == list(rendered.token_ids)
        assert sample.multimodal_features == rendered.features


@pytest.mark.vllm_server("vl")
async def test_text_only_render(backend: str, request: pytest.FixtureRequest) -> None:
    async with vl(backend, request) as h:
        rendered = await h.client.render(text="Hello world")
        assert len(rendered.token_ids) > 0 and not rendered.features.modalities
        chat_only = await h.client.render([{"role": "user", "content": "Hi there"}])
        assert len(chat_only.token_ids) > len(rendered.token_ids) // 2


@pytest.mark.vllm_server("vl")
async def test_aborted_multimodal_sample_continues_with_its_features(
    backend: str, request: pytest.FixtureRequest
) -> None:
    async with vl(backend, request, token_delay_s=0.005) as h:
        rendered = await h.client.render(chat(png()), session_id="vl-2")
        prompt_len = len(rendered.token_ids)
        stream = start_stream(
            h.client,
            "vl-abort",
            {"max_new_tokens": 300, "ignore_eos": True},
            sample=sample_from(rendered, "vl-2"),
        )
        await started(stream)
        await h.client.abort(request_ids=["vl-abort"])
        aborted = await stream.task
        assert aborted.status == pb.SAMPLE_STATUS_ABORTED
        assert_lossless(stream, aborted, prompt_len)
        done = await h.client.generate(aborted, {"max_new_tokens": 300, "ignore_eos": True})
        assert done.status == pb.SAMPLE_STATUS_TRUNCATED and done.response_length == 300
        assert list(done.tokens[: len(aborted.tokens)]) == list(aborted.tokens)
        assert done.multimodal_features == rendered.features


@pytest.mark.vllm_server("vl")
async def test_multimodal_sample_continues_after_abort_all(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Abort(all) pauses the engines, which clears vLLM's media cache: the service must resend."""
    async with vl(backend, request, token_delay_s=0.005) as h:
        rendered = await h.client.render(chat(png()), session_id="mm-all")
        warm = await h.client.generate(
            sample_from(rendered, "mm-all"), {"max_new_tokens": 2, "ignore_eos": True}
        )
        assert warm.status == pb.SAMPLE_STATUS_TRUNCATED  # the engine now caches the image
        prompt_len = len(rendered.token_ids)
        stream = start_stream(
            h.client,
            "mm-all-1",
            {"max_new_tokens": 300, "ignore_eos": True},
            sample=sample_from(rendered, "mm-all"),
        )
        await started(stream)
        await h.client.abort(all=True)
        aborted = await stream.task
        assert aborted.status == pb.SAMPLE_STATUS_ABORTED
        assert_lossless(stream, aborted, prompt_len)
        done = await h.client.generate(aborted, {"max_new_tokens": 300, "ignore_eos": True})
        assert done.status in (pb.SAMPLE_STATUS_COMPLETED, pb.SAMPLE_STATUS_TRUNCATED), done.failure_reason
        assert list(done.tokens[: len(aborted.tokens)]) == list(aborted.tokens)
        again = await h.client.render(chat(png()), session_id="mm-all")
        fresh = await h.client.generate(
            sample_from(again, "mm-all"), {"max_new_tokens": 3, "ignore_eos": True}
        )
        assert fresh.status == pb.SAMPLE_STATUS_TRUNCATED, fresh.failure_reason


@pytest.mark.vllm_server("vl")
async def test_shifted_placeholders_are_realigned(backend: str, request: pytest.FixtureRequest) -> None:
    async with vl(backend, request) as h:
        rendered = await h.client.render(chat(png()), session_id="vl-3")
        greedy = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
        reference = await h.client.generate(sample_from(rendered, "vl-3"), greedy)
        # The trainer prepends a system turn rendered separately: the image moves by its length.
        prefix = list(
            (
                await h.client.render(
                    [{"role": "system", "content": "Be brief."}], add_generation_prompt=False
                )
            ).token_ids
        )
        shifted = sample_from(rendered, "vl-3")
        shifted.tokens[:] = prefix + list(rendered.token_ids)
        moved = await h.client.generate(shifted, greedy)
        item = moved.multimodal_features.modalities[0].items[0]
        original = rendered.features.modalities[0].items[0]
        assert item.placeholder.offset == original.placeholder.offset + len(prefix)
        assert moved.status == pb.SAMPLE_STATUS_TRUNCATED and moved.response_length == 5
        _ = reference


@pytest.mark.vllm_server("vl")
async def test_missing_placeholder_is_invalid_argument(backend: str, request: pytest.FixtureRequest) -> None:
    async with vl(backend, request) as h:
        rendered = await h.client.render(chat(png()))
        broken = sample_from(rendered)
        item = rendered.features.modalities[0].items[0]
        del broken.tokens[item.placeholder.offset : item.placeholder.offset + 2]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(broken, {"max_new_tokens": 3})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(info.value) == "sample.multimodal_features[image].items[0].placeholder"


@pytest.mark.parametrize(
    ("part", "field"),
    [
        (image_part(b"\x89PNG not really"), "chat.messages[0].content[0].image.data"),
        (image_part(png(), "image/gif"), "chat.messages[0].content[0].image.mime_type"),
        (
            pb.ContentPart(image=pb.Image(data_url="data:image/png;base64,%%%")),
            "chat.messages[0].content[0].image.data_url",
        ),
    ],
    ids=["undecodable", "unsupported-mime", "bad-data-url"],
)
@pytest.mark.vllm_server("vl")
async def test_bad_images_are_invalid_argument(
    backend: str, request: pytest.FixtureRequest, part: pb.ContentPart, field: str
) -> None:
    async with vl(backend, request) as h:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.render([{"role": "user", "content": [part, "hi"]}])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(info.value) == field


async def test_too_many_images_is_invalid_argument(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.client.render([{"role": "user", "content": [image_part(png())] * 9}])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(info.value) == "chat.messages[0].content[8]"


async def reset_mm_cache(url: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(url + "/reset_mm_cache") as reply:
        assert reply.status == 200


async def test_media_go_by_hash_once_sent_and_are_resent_after_eviction() -> None:
    async with harness("sim", sim_config={"multimodal": True}) as h:
        engine = h.sims[0]
        rendered = await h.client.render(chat(png()))
        params = {"max_new_tokens": 4, "ignore_eos": True}
        first = await h.client.generate(sample_from(rendered), params)
        assert first.status == pb.SAMPLE_STATUS_TRUNCATED
        sent = engine.stats.last_requests[-1]["features"]["kwargs_data"]["image"]
        assert sent[0] is not None, "the first generate carries the tensors (render caches nothing)"

        second = await h.client.generate(sample_from(rendered), params)
        assert second.status == pb.SAMPLE_STATUS_TRUNCATED and len(second.engine_attempts) == 1
        assert engine.stats.last_requests[-1]["features"]["kwargs_data"]["image"] == [None]

        await reset_mm_cache(engine.url)  # evicted: hash only fails (in-stream 500), resent with kwargs
        third = await h.client.generate(sample_from(rendered), params)
        assert third.status == pb.SAMPLE_STATUS_TRUNCATED
        assert len(third.engine_attempts) == 2 and "media_cache_miss" in third.engine_attempts[0].error

        stripped = sample_from(rendered)
        for modality in stripped.multimodal_features.modalities:
            for item in modality.items:
                item.ClearField("kwargs_data")
        await reset_mm_cache(engine.url)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(stripped, params)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "render" in str(info.value.details())


def _sglang_image_sample() -> tuple[pb.Sample, list[int], bytes]:
    image = b"data:image/png;base64," + base64.b64encode(png())
    tokens = [*PROMPT[:2], 6, 6, 6, 6, *PROMPT[2:]]  # one 56x56 image: 4 placeholder tokens (id 6)
    sample = make_sample(tokens)
    item = pb.MultimodalItem(
        mm_hash="img",
        placeholder=pb.PlaceholderRange(offset=2, length=4),
        kwargs_data=image,
        placeholder_token_id=6,
    )
    sample.multimodal_features.modalities.add(modality="image", items=[item])
    return sample, tokens, image


async def test_an_image_sample_generates_and_continues_on_sglang() -> None:
    """SGLang takes images, not rendered tensors: a sample whose media item carries its image as a
    `data:` URI generates through the replica (the engine expands the placeholder itself, to the
    sample's own run) and an aborted one continues to exactly its budget with the same image —
    on an SGLang whose processor keeps the ids it is sent (kimi, deepseek, Qwen-VL's fast path)."""
    sample, tokens, image = _sglang_image_sample()
    params: dict[str, object] = {"temperature": 0.0, "max_new_tokens": 300, "ignore_eos": True}
    keeps_ids = SGLangOptions(processor_keeps_input_ids=True)
    sim_config = {"multimodal": True, "token_delay_s": 0.002, "sglang": keeps_ids}
    async with harness("sim-sglang", sim_config=sim_config) as h:
        stream = start_stream(h.client, "image", params, sample=sample)
        await started(stream)
        await h.client.abort(request_ids=["image"])
        aborted = await stream.task
        assert aborted.status == pb.SAMPLE_STATUS_ABORTED
        assert_lossless(stream, aborted, prompt_len=len(tokens))
        done = await h.client.generate(aborted, params)
        bodies = [b for b in h.sims[0].core.stats.last_requests if "image_data" in b]
    assert done.status == pb.SAMPLE_STATUS_TRUNCATED and done.response_length == 300
    assert list(done.tokens[: len(aborted.tokens)]) == list(aborted.tokens)
    assert len(bodies) == 2 and all(b["image_data"] == [image.decode()] for b in bodies)
    assert [b["input_ids"].count(6) for b in bodies] == [1, 1]  # one placeholder per image


async def test_an_image_sample_re_tokenized_by_sglang_fails_loudly_naming_the_prompt() -> None:
    """SGLang 0.5.23's default multimodal processors decode input_ids to text and tokenize again
    (base_processor.py 1293-1309): the engine would run other ids than the sample's with no
    error. The adapter compares the engine's `prompt_token_ids` and refuses the sample."""
    sample, _, _ = _sglang_image_sample()
    params: dict[str, object] = {"temperature": 0.0, "max_new_tokens": 8}
    async with harness("sim-sglang", sim_config={"multimodal": True}) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.client.generate(sample, params)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "another prompt than the sample's" in str(err.value.details())
