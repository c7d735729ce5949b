"""The OpenAI front door driven by the official `openai` client, on the simulator and real vLLM.

Checks what a trainer relies on: the trajectory GetTrajectory returns holds exactly the tokens the
engine produced (replayed token-in/token-out through Generate), with mask 0 on everything the
template and the environment inserted, and that Abort and Pause/Resume with a new weight version
act on front-door turns as on Generate.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import grpc
import openai
import pytest

from rollout_grpc.client import make_sample, pb, routed_experts_array
from rollout_grpc.client.multiturn import append_observation, turn_params
from rollout_grpc.server.config import FrontDoorConfig
from rollout_grpc.server.domain.trajectory import DriftPolicy
from rollout_grpc.server.front.openai import tools
from rollout_grpc.server.front.openai.tools import ParsedOutput, ToolCall
from tests.harness import Harness, harness
from tests.support.fleet import session_on

pytestmark = pytest.mark.timeout(300)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12}
#: The front door renders each turn with the engine's chat template; SGLang serves no render route.
SGLANG_NO_CHAT_RENDER = "SGLang serves no chat render route: the front door needs a vLLM engine"


@contextlib.asynccontextmanager
async def front_door(
    backend: str,
    engine_url: str | None,
    policy: DriftPolicy = DriftPolicy.KEEP_PREFIX,
    tool_parser: str = "hermes",
    **sim: Any,
) -> AsyncIterator[Harness]:
    """A replica with the front door on a free port."""
    if backend == "sim-sglang":
        pytest.skip(SGLANG_NO_CHAT_RENDER)
    config = FrontDoorConfig(drift_policy=policy, tool_parser=tool_parser)
    async with harness(backend, engine_url, sim_config=sim or None, openai_port=0, openai=config) as running:
        yield running


def openai_client(h: Harness, session_id: str) -> openai.AsyncOpenAI:
    """The official client, pointed at the session by its base URL alone."""
    base = f"http://127.0.0.1:{h.server.openai_port}/sessions/{session_id}/v1"
    return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)


async def chat(client: openai.AsyncOpenAI, raw: bool = False, **request: Any) -> Any:
    """One chat completion through the official client (loosely typed: tests send vLLM's extras)."""
    completions: Any = client.chat.completions.with_raw_response if raw else client.chat.completions
    return await completions.create(**request)


async def model_name(client: openai.AsyncOpenAI) -> str:
    models = await client.models.list()
    return models.data[0].id


async def trajectory(h: Harness, session_id: str) -> pb.GetTrajectoryResponse:
    return await h.client.get_trajectory(session_id)


async def replay(h: Harness, turn: pb.TrajectoryTurn) -> list[int]:
    """The engine's greedy output for the turn's exact prompt, token-in/token-out via Generate."""
    sample = make_sample(turn.prompt_token_ids)
    params = {"temperature": 0.0, "max_new_tokens": len(turn.response_token_ids)}
    final = await h.client.generate(sample, params)
    return list(final.tokens[len(turn.prompt_token_ids) :])


def assert_training_ready(response: pb.GetTrajectoryResponse) -> None:
    """Every turn's output sits in its sample with mask 1 and its logprobs; the rest is mask 0."""
    trainable = [0] * len(response.samples)
    for turn in response.turns:
        sample = response.samples[turn.sample_index]
        prompt_len = len(sample.tokens) - sample.response_length
        start = len(turn.prompt_token_ids) - prompt_len
        end = start + len(turn.response_token_ids)
        assert list(sample.tokens[: len(turn.prompt_token_ids)]) == list(turn.prompt_token_ids)
        assert list(sample.tokens[prompt_len + start : prompt_len + end]) == list(turn.response_token_ids)
        assert list(sample.loss_mask[start:end]) == [1] * (end - start)
        assert list(sample.rollout_log_probs[start:end]) == pytest.approx(list(turn.response_logprobs))
        trainable[turn.sample_index] += end - start
    for sample, count in zip(response.samples, trainable, strict=True):
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        assert sum(sample.loss_mask) == count, "only generated tokens are trainable"
        for mask, logprob in zip(sample.loss_mask, sample.rollout_log_probs, strict=True):
            if mask == 0:
                assert logprob == 0.0
        if sample.weight_versions:
            covered = sum(w.end - w.start for w in sample.weight_versions)
            assert covered == count, "weight-version spans cover exactly the generated positions"


async def test_three_turn_tool_conversation_is_captured_token_exact(
    backend: str, engine_url: str | None
) -> None:
    session = "s-" + secrets.token_hex(4)
    async with front_door(backend, engine_url) as h:
        client = openai_client(h, session)
        model = await model_name(client)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ]
        first = await chat(
            client,
            model=model,
            messages=messages,
            tools=[WEATHER_TOOL],
            extra_body={"return_token_ids": True},
            **GREEDY,
        )
        # The random-weight model writes no tool call: the harness scripts the call it would make.
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "celsius": 21}'},
        ]
        second = await chat(client, model=model, messages=messages, tools=[WEATHER_TOOL], **GREEDY)
        messages += [
            {"role": "assistant", "content": second.choices[0].message.content},
            {"role": "user", "content": "Thanks!"},
        ]
        chunks = [
            c
            async for c in await chat(
                client, model=model, messages=messages, tools=[WEATHER_TOOL], stream=True, **GREEDY
            )
        ]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")

        response = await trajectory(h, session)
        assert len(response.turns) == 3
        assert len(response.samples) == 1, "keep_prefix keeps the session one sample"
        assert_training_ready(response)
        first_ids = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
        assert list(response.turns[0].prompt_token_ids) == first_ids[0]
        assert list(response.turns[0].response_token_ids) == first_ids[1]
        assert response.samples[0].response.endswith(streamed)
        for turn in response.turns:
            assert await replay(h, turn) == list(turn.response_token_ids)


class ScriptedToolParser:
    """Reads every output as one call: the random-weight model never writes a real one."""

    start_marker = ""

    def parse(self, text: str) -> ParsedOutput:
        arguments = json.dumps({"city": "Oslo", "model_said": text})
        return ParsedOutput(content=None, tool_calls=[ToolCall("get_weather", arguments)])


@pytest.mark.parametrize("stream", [False, True])
async def test_parsed_tool_calls_come_back_as_openai_tool_calls(stream: bool) -> None:
    tools.PARSERS["scripted"] = ScriptedToolParser  # type: ignore[assignment]
    session = "tools-" + secrets.token_hex(4)
    try:
        async with front_door("sim", None, tool_parser="scripted") as h:
            client = openai_client(h, session)
            model = await model_name(client)
            request: dict[str, Any] = {
                "model": model,
                "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [WEATHER_TOOL],
                **GREEDY,
            }
            if stream:
                chunks = [c async for c in await chat(client, stream=True, **request)]
                deltas = [c.choices[0].delta for c in chunks if c.choices]
                calls = [tc for d in deltas for tc in (d.tool_calls or [])]
                finish = chunks[-1].choices[0].finish_reason
                name, arguments = calls[0].function.name, calls[0].function.arguments
            else:
                result = await chat(client, **request)
                finish = result.choices[0].finish_reason
                calls = result.choices[0].message.tool_calls or []
                name, arguments = calls[0].function.name, calls[0].function.arguments
            assert len(calls) == 1
            assert finish == "tool_calls"
            assert name == "get_weather"
            assert json.loads(arguments or "{}")["city"] == "Oslo"
            recorded = (await trajectory(h, session)).turns[0]
            assert json.loads(recorded.tool_calls_json[0])["function"]["name"] == "get_weather"
    finally:
        del tools.PARSERS["scripted"]


@pytest.mark.parametrize("policy", [DriftPolicy.KEEP_PREFIX, DriftPolicy.SPLIT])
async def test_drift_keeps_the_prefix_or_splits(
    backend: str, engine_url: str | None, policy: DriftPolicy
) -> None:
    """An assistant message re-rendered without its tool call (this template drops it) drifts."""
    session = "drift-" + secrets.token_hex(4)
    async with front_door(backend, engine_url, policy) as h:
        client = openai_client(h, session)
        model = await model_name(client)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"}]
        await chat(client, model=model, messages=messages, tools=[WEATHER_TOOL], **GREEDY)
        call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "rain"},
        ]
        await chat(client, model=model, messages=messages, tools=[WEATHER_TOOL], **GREEDY)
        response = await trajectory(h, session)
        assert response.turns[1].drift
        assert len(response.samples) == (1 if policy == DriftPolicy.KEEP_PREFIX else 2)
        assert_training_ready(response)
        if policy == DriftPolicy.KEEP_PREFIX:
            # The engine was sent the recorded tokens: the first turn's output is its prefix.
            recorded = list(response.turns[0].prompt_token_ids) + list(response.turns[0].response_token_ids)
            assert list(response.turns[1].prompt_token_ids[: len(recorded)]) == recorded


async def test_an_extending_template_needs_no_drift_handling(backend: str, engine_url: str | None) -> None:
    """When the model's reply re-renders to its own tokens, turns simply extend each other."""
    session = "ext-" + secrets.token_hex(4)
    async with front_door(backend, engine_url, DriftPolicy.SPLIT) as h:
        client = openai_client(h, session)
        model = await model_name(client)
        # A reply of just the end-of-turn token renders back identically: content "".
        eos_only: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4, "logit_bias": {"2": 100}}
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Say nothing."}]
        first = await chat(client, model=model, messages=messages, **eos_only)
        assert first.choices[0].message.content == ""
        messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "Again."}]
        await chat(client, model=model, messages=messages, **eos_only)
        response = await trajectory(h, session)
        assert not response.turns[1].drift
        assert len(response.samples) == 1
        assert_training_ready(response)
        sample = response.samples[0]
        inserted = sample.response_length - sum(sample.loss_mask)
        assert inserted > 0, "the template's glue and the user message are in the sample, masked"


async def test_abort_mid_turn_returns_partial_output(backend: str, engine_url: str | None) -> None:
    session = "abort-" + secrets.token_hex(4)
    async with front_door(backend, engine_url, token_delay_s=0.005) as h:
        client = openai_client(h, session)
        model = await model_name(client)
        stream = await chat(
            client,
            model=model,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            stream=True,
            max_tokens=3000,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        text = ""
        finish = None
        aborted = False
        async for chunk in stream:
            if not chunk.choices:
                continue
            text += chunk.choices[0].delta.content or ""
            if text and not aborted:
                aborted = True
                result = await h.client.abort(session_id=session)
                assert result.aborted == 1
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "abort"
        response = await trajectory(h, session)
        (turn,) = response.turns
        assert turn.finish_reason == pb.FINISH_REASON_ABORT
        assert 0 < len(turn.response_token_ids) < 3000
        assert response.samples[0].status == pb.SAMPLE_STATUS_ABORTED
        assert response.samples[0].response == text


async def test_pause_resume_new_weight_version_between_turns(backend: str, engine_url: str | None) -> None:
    session = "weights-" + secrets.token_hex(4)
    async with front_door(backend, engine_url) as h:
        client = openai_client(h, session)
        model = await model_name(client)
        await h.client.resume(weight_version="v1")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "One."}]
        first = await chat(client, model=model, messages=messages, **GREEDY)
        await h.client.pause("wait")
        await h.client.resume(weight_version="v2")
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Two."},
        ]
        await chat(client, model=model, messages=messages, **GREEDY)
        response = await trajectory(h, session)
        assert [w.version for w in response.turns[0].weight_versions] == ["v1"]
        assert [w.version for w in response.turns[1].weight_versions] == ["v2"]
        sample = response.samples[0]
        assert [w.version for w in sample.weight_versions] == ["v1", "v2"]
        assert_training_ready(response)


async def test_header_sessions_errors_and_unknown_trajectory() -> None:
    async with front_door("sim", None) as h:
        base = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{h.server.openai_port}/v1", api_key="x", max_retries=0
        )
        model = await model_name(base)
        raw = await chat(
            base,
            raw=True,
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_headers={"X-Session-Id": "by-header"},
        )
        assert raw.headers["x-session-id"] == "by-header"
        assert len((await trajectory(h, "by-header")).turns) == 1
        with pytest.raises(openai.BadRequestError) as bad:
            await chat(base, model=model, messages=[{"role": "user", "content": "hi"}], n=2)
        assert "n" in str(bad.value)
        with pytest.raises(openai.BadRequestError):
            await chat(
                base,
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Session-Id": "failed"},
                temperature=-1.0,
            )
        with pytest.raises(grpc.aio.AioRpcError) as never_generated:
            await trajectory(h, "failed")
        assert never_generated.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(openai.BadRequestError) as bad_temp:
            await chat(base, model=model, messages=[{"role": "user", "content": "hi"}], temperature=-1.0)
        assert "temperature" in str(bad_temp.value)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await trajectory(h, "never-seen")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await trajectory(h, "")
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "session_id" in (empty.value.details() or "")
        with pytest.raises(openai.BadRequestError) as forced:
            await chat(
                base,
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                tools=[WEATHER_TOOL],
                tool_choice="required",
            )
        assert "tool_choice" in str(forced.value)
        removed = await h.client.get_trajectory("by-header", remove=True)
        assert len(removed.turns) == 1
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await trajectory(h, "by-header")
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_multi_turn_over_generate_with_observations_and_a_turn_budget(
    backend: str, engine_url: str | None
) -> None:
    """Without the front door: one sample, observations masked, each turn within its own budget."""
    async with front_door(backend, engine_url) as h:
        rendered = await h.client.render([{"role": "user", "content": "Count."}], session_id="mt")
        sample = make_sample(rendered.token_ids, session_id="mt")
        base = {"temperature": 1.0, "ignore_eos": True}
        sample = await h.client.generate(sample, turn_params(sample, base, 5))
        assert sample.response_length == 5
        observation = list(rendered.token_ids[:4])  # stands for a tokenised tool result
        sample = append_observation(sample, observation)
        sample = await h.client.generate(sample, turn_params(sample, base, 6, total=100))
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED
        assert sample.response_length == 5 + 4 + 6, "the turn budget excludes earlier tokens"
        assert list(sample.loss_mask) == [1] * 5 + [0] * 4 + [1] * 6
        assert list(sample.rollout_log_probs[5:9]) == [0.0] * 4
        assert list(sample.tokens[len(rendered.token_ids) + 5 :][:4]) == observation
        spans = [(w.start, w.end) for w in sample.weight_versions]
        if spans:
            assert spans[0][0] == 0 and spans[-1][1] == 15
            assert all(not (s < 9 and e > 5) for s, e in spans), "no span covers the observation"


async def test_a_turn_fails_over_to_another_engine_without_loss() -> None:
    """The session's engine drops the stream mid-turn: the turn continues on the other engine."""
    config = FrontDoorConfig()
    async with harness(
        "sim", sim_count=2, sim_config={"token_delay_s": 0.001}, openai_port=0, openai=config
    ) as h:
        bad, good = h.sims
        bad.faults.drop_connection = 1
        bad.faults.drop_after_tokens = 40
        session = session_on(h.sims, bad, h.server.pool.pick)
        client = openai_client(h, session)
        model = await model_name(client)
        reply = await chat(
            client,
            model=model,
            messages=[{"role": "user", "content": "Go on."}],
            max_tokens=120,
            temperature=1.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert reply.choices[0].finish_reason == "length"
        assert len(reply.choices[0].model_extra["token_ids"]) == 120
        response = await trajectory(h, session)
        assert list(response.turns[0].response_token_ids) == reply.choices[0].model_extra["token_ids"]
        assert_training_ready(response)
        attempts = response.samples[0].engine_attempts
        assert [a.engine for a in attempts] == [bad.url, good.url]
        assert 40 <= attempts[0].end < 120 and attempts[0].error, "the first engine dropped mid-turn"


async def test_routed_experts_are_joined_across_turns() -> None:
    """R3 per turn asks only for new positions; the trajectory's rows cover every token but the last."""
    moe = {"moe_layers": 4, "moe_experts": 16, "moe_topk": 2, "return_routed_experts": True}
    config = FrontDoorConfig(return_routed_experts=True)
    async with harness("sim", sim_config=moe, openai_port=0, openai=config) as h:
        session = "r3-" + secrets.token_hex(4)
        client = openai_client(h, session)
        model = await model_name(client)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "One."}]
        first = await chat(client, model=model, messages=messages, **GREEDY)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Two."},
        ]
        await chat(client, model=model, messages=messages, **GREEDY)
        (sample,) = (await trajectory(h, session)).samples
        experts = routed_experts_array(sample)
        assert experts is not None
        assert sample.routed_experts.start == 0
        assert experts.shape == (len(sample.tokens) - 1, 4, 2)
        # The same routing as one engine call over the whole trajectory (the sim routes by context).
        whole = await h.client.generate(
            make_sample(sample.tokens[:-1]),
            {"temperature": 0.0, "max_new_tokens": 1},
            {"return_routed_experts": True},
        )
        replayed = routed_experts_array(whole)
        assert replayed is not None
        assert (replayed[: len(sample.tokens) - 1] == experts).all()


async def test_admission_applies_to_front_door_turns() -> None:
    """One slot, no queue: a second concurrent turn is refused with 429 and Retry-After."""
    config = FrontDoorConfig()
    async with harness(
        "sim",
        sim_config={"token_delay_s": 0.01},
        server_concurrency=1,
        max_queue=0,
        retry_after_s=2.0,
        openai_port=0,
        openai=config,
    ) as h:
        busy = openai_client(h, "busy")
        model = await model_name(busy)
        stream = await chat(
            busy,
            model=model,
            messages=[{"role": "user", "content": "Long."}],
            stream=True,
            max_tokens=2000,
            extra_body={"ignore_eos": True},
        )
        chunks = stream.__aiter__()
        await anext(chunks)  # the turn holds the only slot
        with pytest.raises(openai.RateLimitError) as refused:
            await chat(openai_client(h, "second"), model=model, messages=[{"role": "user", "content": "hi"}])
        assert refused.value.response.headers["retry-after"] == "2"
        await h.client.abort(session_id="busy")
        finish = [
            c.choices[0].finish_reason async for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert finish == ["abort"]


async def test_a_harness_that_hangs_up_aborts_its_turn_which_stays_recorded() -> None:
    async with front_door("sim", None, token_delay_s=0.005) as h:
        client = openai_client(h, "hangup")
        model = await model_name(client)
        stream = await chat(
            client,
            model=model,
            messages=[{"role": "user", "content": "Long."}],
            stream=True,
            max_tokens=3000,
            extra_body={"ignore_eos": True},
        )
        chunks = stream.__aiter__()
        await anext(chunks)
        await stream.close()
        response = await trajectory(h, "hangup")  # waits for the turn to end
        (turn,) = response.turns
        assert turn.finish_reason == pb.FINISH_REASON_ABORT
        assert 0 < len(turn.response_token_ids) < 3000
        assert_training_ready(response)
