"""Render: chat messages (text and images) or plain text -> engine token ids and features.

The engine's template and processor do the work (`/v1/chat/completions/render`,
`/v1/completions/render`); this module validates the media first, so that a bad image is an
INVALID_ARGUMENT naming the part rather than an engine error, and routes by session so the
engine that rendered (and cached) the media also serves the session's generations.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from rollout_grpc.server.domain.chat import ChatRenderRequest
from rollout_grpc.server.domain.errors import InvalidArgument, NotFound, Unavailable
from rollout_grpc.server.domain.model import MultimodalFeatures
from rollout_grpc.server.engines.api import EngineError, EngineRejected
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool

SUPPORTED_MIME = {"image/png": "PNG", "image/jpeg": "JPEG"}

#: (kind, payload, mime): ("text", str, "") or ("image", bytes or data URL, mime type).
Part = tuple[str, str | bytes, str]


@dataclass(slots=True)
class Rendered:
    """Token ids with placeholders expanded, features, and the engine that rendered them."""

    token_ids: list[int]
    features: MultimodalFeatures | None
    engine: str


def _decode_payload(payload: str | bytes, mime: str, field: str) -> tuple[bytes, str, str]:
    """(bytes, mime type, field naming them) of an image part given as bytes or a data URL."""
    if isinstance(payload, bytes):
        return payload, mime, field + ".image.data"
    where = field + ".image.data_url"
    if not payload.startswith("data:") or ";base64," not in payload:
        raise InvalidArgument(where, "must be a data:<mime>;base64,<data> URL")
    header, encoded = payload[5:].split(";base64,", 1)
    try:
        return base64.b64decode(encoded, validate=True), header, where
    except binascii.Error as exc:
        raise InvalidArgument(where, f"invalid base64: {exc}") from None


def _check_image(data: bytes, mime: str, where: str, max_pixels: int) -> None:
    """Open the image, check its size from the header BEFORE decoding, then decode it fully.

    CPU-bound (seconds for a large image): run it off the event loop. A decompression bomb (a small
    file that decodes to billions of pixels) is refused from its header, never decoded.
    """
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != SUPPORTED_MIME[mime]:
                raise InvalidArgument(where, f"the bytes are {image.format}, not {mime}")
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidArgument(
                    where, f"the image is {width}x{height} pixels, more than the limit of {max_pixels}"
                )
            image.load()
    except Image.DecompressionBombError as exc:
        raise InvalidArgument(where, f"the image is too large: {exc}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InvalidArgument(where, f"cannot decode the image: {exc}") from None


async def _image_data_url(
    payload: str | bytes, mime: str, field: str, *, max_pixels: int, max_bytes: int
) -> str:
    """Validate an image part (size limits first, decoding off the event loop); a data URL."""
    if isinstance(payload, str) and len(payload) > max_bytes * 4 // 3 + 64:
        raise InvalidArgument(field + ".image.data_url", f"more than {max_bytes} bytes of image data")
    data, mime, where = _decode_payload(payload, mime, field)
    if len(data) > max_bytes:
        raise InvalidArgument(where, f"{len(data)} bytes of image data, more than the limit of {max_bytes}")
    if mime not in SUPPORTED_MIME:
        raise InvalidArgument(
            field + ".image.mime_type",
            f"unsupported {mime!r}; use one of {', '.join(sorted(SUPPORTED_MIME))}",
        )
    await asyncio.to_thread(_check_image, data, mime, where, max_pixels)
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


@contextlib.contextmanager
def _render_errors(field: str | None) -> Iterator[None]:
    """Engine failures of a render call as domain errors. A rejection names the caller's `field`,
    or with None the request field the engine named (the OpenAI door passes the body through, so
    the engine's `param` is the caller's field)."""
    try:
        yield
    except EngineRejected as exc:
        if exc.not_found:
            raise NotFound(f"engine {exc.url}: {exc.message}") from exc
        named = field if field is not None else exc.param or "messages"
        raise InvalidArgument(named, f"rejected by the engine: {exc.message}") from exc
    except EngineError as exc:
        raise Unavailable(f"engine {exc.url} could not render: {exc.message}") from exc


class RenderService:
    """Renders prompts on the engine pool."""

    def __init__(
        self,
        pool: EnginePool,
        max_images: int = 8,
        *,
        max_pixels: int = 64_000_000,
        max_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        self._pool = pool
        self._max_images = max_images
        self._max_pixels = max_pixels
        self._max_bytes = max_bytes

    def _engine(self, session_id: str) -> EngineHandle:
        """The session's engine (it will cache the media for the session's generations)."""
        engine = self._pool.pick(session_id)
        if engine is None:
            raise Unavailable("no healthy engine is available to render")
        return engine

    async def render_chat(
        self,
        messages: list[tuple[str, list[Part]]],
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any],
        session_id: str,
        model: str,
    ) -> Rendered:
        """Render a chat conversation with the engine's chat template and media processor."""
        if not messages:
            raise InvalidArgument("chat.messages", "must hold at least one message")
        images = 0
        body_messages: list[dict[str, Any]] = []
        for i, (role, parts) in enumerate(messages):
            if not role:
                raise InvalidArgument(f"chat.messages[{i}].role", "must be set")
            content: list[dict[str, Any]] = []
            for j, (kind, payload, mime) in enumerate(parts):
                field = f"chat.messages[{i}].content[{j}]"
                if kind == "text":
                    content.append({"type": "text", "text": payload})
                else:
                    images += 1
                    if images > self._max_images:
                        raise InvalidArgument(field, f"more than {self._max_images} images in one prompt")
                    url = await _image_data_url(
                        payload, mime, field, max_pixels=self._max_pixels, max_bytes=self._max_bytes
                    )
                    content.append({"type": "image_url", "image_url": {"url": url}})
            body_messages.append({"role": role, "content": content})
        request = ChatRenderRequest(
            body_messages,
            add_generation_prompt=add_generation_prompt,
            model=model,
            chat_template_kwargs=chat_template_kwargs or None,
        )
        return await self.render_request(request, session_id=session_id, field="chat")

    async def render_request(
        self, request: ChatRenderRequest, *, session_id: str, field: str | None = None
    ) -> Rendered:
        """Render a conversation already in the engines' chat shape: the one chat-render path of
        both doors (the gRPC door's parts come through `render_chat`, the OpenAI door's body as
        it is). A rejection names `field` (None: the request field the engine named)."""
        engine = self._engine(session_id)
        with _render_errors(field):
            result = await engine.client.render_chat(request)
        return Rendered(result.token_ids, result.features, engine.url)

    async def render_text(self, text: str, *, session_id: str, model: str) -> Rendered:
        """Render plain text without a template."""
        if not text:
            raise InvalidArgument("text", "must not be empty")
        engine = self._engine(session_id)
        with _render_errors("text"):
            result = await engine.client.render_text(text, model)
        return Rendered(result.token_ids, None, engine.url)
