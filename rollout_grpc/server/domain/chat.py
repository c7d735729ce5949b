"""What a door asks of the engines' chat templates and model lists, engine-neutral.

These values cross from the front doors through the facade to an engine adapter, so they live in
the domain (a door imports nothing below the facade; `engines/api.py` re-exports them under the
names its adapters use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model an engine serves."""

    #: The served model name (what `model` in a request must match).
    id: str
    #: The longest sequence (prompt + output) the engine accepts; None when it does not say.
    max_model_len: int | None = None
    #: Unix time the engine reports for the model; None when it does not say.
    created: int | None = None


@dataclass(frozen=True, slots=True)
class ChatRenderRequest:
    """A conversation for the engine's own chat template and media processor.

    Messages are in OpenAI's chat shape (role, content parts with `image_url` data URLs, tool
    calls), which every engine kind's chat template takes; each adapter builds its own request
    body from these fields.
    """

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    #: The served model name; empty: the engine's only model.
    model: str = ""
    #: OpenAI tool definitions the template renders into the prompt (tool calls are parsed by the
    #: front door, never by the engine).
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: A template that replaces the engine's own.
    chat_template: str | None = None
    documents: list[dict[str, Any]] | None = None
