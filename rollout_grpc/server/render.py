"""Render: chat messages (text and images) or plain text -> engine token ids and features.

The engine's template and processor do the work (`/v1/chat/completions/render`,
`/v1/completions/render`); this module validates the media first, so that a bad image is an
INVALID_ARGUMENT naming the part rather than an engine error, and routes by session so the
engine that rendered (and cached) the media also serves the session's generations.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from rollout_grpc.server.domain import MultimodalFeatures
from rollout_grpc.server.engine_api import EngineError, EngineRejected
from rollout_grpc.server.engines import EngineHandle, EnginePool
from rollout_grpc.server.errors import InvalidArgument, NotFound, Unavailable

SUPPORTED_MIME = {"image/png": "PNG", "image/jpeg": "JPEG"}

#: (kind, payload, mime): ("text", str, "") or ("image", bytes or data URL, mime type).
Part = tuple[str, str | bytes, str]


@dataclass(slots=True)
class Rendered:
    """Token ids with placeholders expanded, features, and the engine that rendered them."""

    token_ids: list[int]
    features: MultimodalFeatures | None
    engine: str


def _image_data_url(payload: str | bytes, mime: str, field: str) -> str:
    """Validate an image part and return it as a data URL."""
    if isinstance(payload, str):
        if not payload.startswith("data:") or ";base64," not in payload:
            raise InvalidArgument(field + ".image.data_url", "must be a data:<mime>;base64,<data> URL")
        header, encoded = payload[5:].split(";base64,", 1)
        mime = header
        try:
            data = base64.b64decode(encoded, validate=True)
        except binascii.Error as exc:
            raise InvalidArgument(field + ".image.data_url", f"invalid base64: {exc}") from None
        where = field + ".image.data_url"
    else:
        data = payload
        where = field + ".image.data"
    if mime not in SUPPORTED_MIME:
        raise InvalidArgument(
            field + ".image.mime_type",
            f"unsupported {mime!r}; use one of {', '.join(sorted(SUPPORTED_MIME))}",
        )
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != SUPPORTED_MIME[mime]:
                raise InvalidArgument(where, f"the bytes are {image.format}, not {mime}")
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InvalidArgument(where, f"cannot decode the image: {exc}") from None
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


@contextlib.contextmanager
def _engine_errors(field: str) -> Iterator[None]:
    """Engine failures of a render call as domain errors (a rejection names the caller's `field`)."""
    try:
        yield
    except EngineRejected as exc:
        if exc.not_found:
            raise NotFound(f"engine {exc.url}: {exc.message}") from exc
        raise InvalidArgument(field, f"rejected by the engine: {exc.message}") from exc
    except EngineError as exc:
        raise Unavailable(f"engine {exc.url} could not render: {exc.message}") from exc


class RenderService:
    """Renders prompts on the engine pool."""

    def __init__(self, pool: EnginePool, max_images: int = 8) -> None:
        self._pool = pool
        self._max_images = max_images

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
                    content.append(
                        {"type": "image_url", "image_url": {"url": _image_data_url(payload, mime, field)}}
                    )
            body_messages.append({"role": role, "content": content})
        body: dict[str, Any] = {"messages": body_messages, "add_generation_prompt": add_generation_prompt}
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        if model:
            body["model"] = model
        engine = self._engine(session_id)
        with _engine_errors("chat"):
            result = await engine.client.render_chat(body)
        return Rendered(result.token_ids, result.features, engine.url)

    async def render_text(self, text: str, *, session_id: str, model: str) -> Rendered:
        """Render plain text without a template."""
        if not text:
            raise InvalidArgument("text", "must not be empty")
        engine = self._engine(session_id)
        with _engine_errors("text"):
            result = await engine.client.render_text(text, model)
        return Rendered(result.token_ids, None, engine.url)
