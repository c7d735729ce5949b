"""The simulator's `/v1/chat/completions` answers like vLLM's (the same checks on both backends).

Driven by the official `openai` client, as the agent benchmark does: the response shapes parse, the
prompt is what `/v1/chat/completions/render` makes of the messages, and with `return_token_ids` the
choice carries the generated ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from rollout_grpc.sim import SimConfig, SimEngine

MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


@contextlib.asynccontextmanager
async def engine(backend: str, engine_url: str | None) -> AsyncIterator[str]:
    if backend == "vllm":
        assert engine_url is not None
        yield engine_url
        return
    async with SimEngine(SimConfig(seed=0)) as sim:
        yield sim.url


async def test_chat_completions_shape_and_token_ids(backend: str, engine_url: str | None) -> None:
    async with engine(backend, engine_url) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = (await client.models.list()).data[0].id
        create: Any = client.chat.completions.create
        reply = await create(
            model=model,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0.0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert reply.object == "chat.completion"
        choice = reply.choices[0]
        assert choice.finish_reason == "length"
        assert choice.message.role == "assistant"
        assert isinstance(choice.message.content, str)
        assert len(choice.model_extra["token_ids"]) == 6
        assert reply.usage.completion_tokens == 6
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                url + "/v1/chat/completions/render", json={"model": model, "messages": MESSAGES}
            ) as resp,
        ):
            rendered = (await resp.json())["token_ids"]
        assert reply.model_extra["prompt_token_ids"] == rendered
        assert reply.usage.prompt_tokens == len(rendered)

        stream = await create(
            model=model,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == choice.message.content, "greedy: the stream says what the reply said"


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_model_is_404(stream: bool) -> None:
    async with SimEngine(SimConfig(seed=0)) as sim:
        client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
        create: Any = client.chat.completions.create
        with pytest.raises(openai.NotFoundError):
            await create(model="no-such-model", messages=MESSAGES, max_tokens=2, stream=stream)
