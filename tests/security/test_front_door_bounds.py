"""The front door's bounds hold for everyone: prompt size before render, session ids, HTTP errors in
OpenAI's shape, clients that leave, and bodies that never finish arriving.

A 60 MiB chat turn (under the 64 MiB body cap) used to go whole to the engine's renderer: the
engine stopped answering, its health probe marked it unhealthy and every other caller got 503 for
minutes. A control character in `X-Session-Id` ran the turn and then dropped the connection
without a response; a non-UTF-8 one was a plain 500 without a log line. Raw sockets send what the
HTTP clients refuse to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from structlog.testing import capture_logs

from rollout_grpc.client import AsyncRolloutClient
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.server.config import FrontDoorConfig
from rollout_grpc.server.facade.calls import CallRecord
from tests.harness import running_server, sim_engines
from tests.support.service import field_violation

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
TURN: dict[str, Any] = {"model": "", "max_tokens": 2, "temperature": 0.0}


@contextlib.asynccontextmanager
async def front_door(**config: Any) -> AsyncIterator[RolloutServer]:
    async with (
        sim_engines(1) as sims,
        running_server([s.url for s in sims], openai_port=0, **config) as server,
    ):
        yield server


def chat_url(server: RolloutServer, path: str = "/v1/chat/completions") -> str:
    return f"http://127.0.0.1:{server.openai_port}{path}"


async def post(server: RolloutServer, body: bytes, **headers: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            chat_url(server), data=body, headers={"Content-Type": "application/json", **headers}
        ) as resp,
    ):
        return resp.status, orjson.loads(await resp.read())


def hello(text: str = "Hello there") -> bytes:
    return orjson.dumps({**TURN, "messages": [{"role": "user", "content": text}]})


def assert_openai_error(body: dict[str, Any], status: int, param: str | None = None) -> str:
    """The error envelope of OpenAI: {"error": {message, type, param, code}}; returns the message."""
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["code"] == status and error["param"] == param, body
    assert isinstance(error["message"], str) and error["message"]
    return str(error["message"])


async def raw_exchange(port: int, request: bytes) -> bytes:
    """Send `request` bytes on a fresh connection and read the whole answer (the server closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=30)
    finally:
        writer.close()


def raw_chat(body: bytes, session_header: bytes | None = None, path: bytes = b"/v1") -> bytes:
    header = b"X-Session-Id: " + session_header + b"\r\n" if session_header is not None else b""
    return (
        b"POST " + path + b"/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
        + header
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def parse_raw(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, orjson.loads(body)


class Closed:
    """Waits for the front door's next closed call record (its log line is written then)."""

    def __init__(self, server: RolloutServer) -> None:
        self.records: asyncio.Queue[CallRecord] = asyncio.Queue()
        server.calls.listeners.append(self.records.put_nowait)

    async def next(self) -> CallRecord:
        return await asyncio.wait_for(self.records.get(), timeout=30)


# ----------------------------------------------------------------------------- prompt size


async def test_a_prompt_over_the_cap_is_400_naming_messages_before_any_render() -> None:
    async with front_door(max_prompt_chars=1000) as server:
        status, body = await post(server, hello("x" * 2000))
        message = assert_openai_error(body, 400, "messages")
        counted = re.search(r"(\d+) characters of prompt text", message)
        assert "max_prompt_chars=1000" in message and counted and int(counted[1]) >= 2000, message
        tools = [{"type": "function", "function": {"name": "f", "description": "y" * 2000}}]
        status, body = await post(
            server, orjson.dumps({**TURN, "messages": [{"role": "user", "content": "hi"}], "tools": tools})
        )
        assert_openai_error(body, 400, "tools")
        status, _ = await post(server, hello("x" * 900))
        assert status == 200


async def test_a_60mib_turn_is_refused_and_the_engine_stays_healthy_for_others() -> None:
    """The default cap holds under the body cap: the giant turn never reaches the engine."""
    async with front_door() as server:
        status, body = await post(server, hello("x" * (60 * MIB)))
        assert status == 400
        assert "max_prompt_chars" in assert_openai_error(body, 400, "messages")
        assert all(engine.usable for engine in server.pool.engines)
        status, body = await post(server, hello())
        assert status == 200 and body["choices"][0]["message"]["content"] is not None


# ----------------------------------------------------------------------------- session ids


@pytest.mark.parametrize(
    ("header", "path"),
    [
        # A control character reaches the handler through the path (aiohttp's parser refuses it in
        # a header): it used to run the turn, then break the response header that echoes it.
        (None, b"/sessions/bad%01id/v1"),
        (None, b"/sessions/x%0d%0aSet-Cookie:%20a/v1"),
        (None, b"/sessions/%ff%fe/v1"),
        (b"caf\xc3\xa9", b"/v1"),
        (b"\xff\xfe-not-utf8", b"/v1"),  # was a plain 500 without a log line
        (b"a b", b"/v1"),
        (b"x" * 201, b"/v1"),
    ],
)
async def test_session_ids_are_validated_like_request_ids(header: bytes | None, path: bytes) -> None:
    async with front_door() as server:
        closed = Closed(server)
        with capture_logs() as logs:
            answer = await raw_exchange(server.openai_port or 0, raw_chat(hello(), header, path))
            record = await closed.next()
        status, body = parse_raw(answer)
        assert status == 400
        assert "must be 1-200 characters" in assert_openai_error(body, 400, "session_id")
        assert record.http_status == 400 and not record.request_id  # no turn was run
        assert [e["code"] for e in logs if e["event"] == "openai_done"] == [400]


async def test_a_valid_session_id_header_is_used() -> None:
    async with front_door() as server:
        status, body = await post(server, hello(), **{"X-Session-Id": "agent-7:run/3"})
        assert status == 200 and body["id"].startswith("chatcmpl-agent-7:run/3.t0.")


# ----------------------------------------------------------------------------- HTTP errors


async def test_404_405_and_413_are_openai_errors() -> None:
    async with front_door() as server, aiohttp.ClientSession() as session:
        async with session.get(chat_url(server, "/v1/nothing-here")) as resp:
            assert resp.status == 404
            assert_openai_error(orjson.loads(await resp.read()), 404)
        async with session.get(chat_url(server)) as resp:
            assert resp.status == 405
            assert "takes POST" in assert_openai_error(orjson.loads(await resp.read()), 405)
        async with session.post(chat_url(server), data=b" " * (64 * MIB + 1)) as resp:
            assert resp.status == 413
            assert "64 MiB" in assert_openai_error(orjson.loads(await resp.read()), 413)


async def test_a_client_that_leaves_mid_body_is_logged_499_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with front_door() as server:
        closed = Closed(server)
        _, writer = await asyncio.open_connection("127.0.0.1", server.openai_port)
        writer.write(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"mess')
        await writer.drain()
        with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
            writer.close()
            record = await closed.next()
    assert record.http_status == 499 and record.code == "CANCELLED"
    assert not [r for r in caplog.records if r.name.startswith("aiohttp")], caplog.text


async def test_a_body_that_does_not_finish_arriving_is_408() -> None:
    async with front_door(openai=FrontDoorConfig(body_timeout_s=0.5)) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.openai_port)
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Length: 1000\r\n\r\n{"
            )
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), timeout=20)
        finally:
            writer.close()
        status, body = parse_raw(answer)
        assert status == 408
        assert "body_timeout_s=0.5" in assert_openai_error(body, 408)


async def test_the_render_rpc_is_held_to_the_same_prompt_cap() -> None:
    """gRPC Render renders chat messages on an engine too: the same cap, before the engine."""
    async with (
        front_door(max_prompt_chars=1000) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", retry=None) as client,
    ):
        for kwargs, where in (
            ({"text": "x" * 1001}, "text"),
            ({"messages": [{"role": "user", "content": "y" * 1001}]}, "chat.messages"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.render(**kwargs)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field_violation(err.value) == where
            assert "max_prompt_chars=1000" in (err.value.details() or "")
        assert len((await client.render(text="z" * 100)).token_ids) > 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stream", "yes", "stream: must be a boolean, got 'yes'"),
        ("stream", 1, "stream: must be a boolean, got 1"),
        ("max_tokens", 1e9, "max_tokens: must be an integer, got 1000000000.0"),
        ("temperature", "hot", "temperature: must be a number, got 'hot'"),
    ],
)
async def test_a_value_of_the_wrong_type_is_a_400_naming_the_field(
    field: str, value: Any, message: str
) -> None:
    """`"stream": "yes"` used to stream (any truthy value did); type errors said "must be a int"."""
    async with front_door() as server:
        body = {**TURN, "messages": [{"role": "user", "content": "hi"}], field: value}
        status, answer = await post(server, orjson.dumps(body))
    assert status == 400
    assert assert_openai_error(answer, 400, field) == message


async def test_a_request_without_a_model_is_answered_with_the_served_models_name() -> None:
    """OpenAI's responses always name the model; without `model` in the request they said ""."""
    async with front_door() as server:
        status, answer = await post(server, hello())
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                chat_url(server),
                json={**TURN, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            ) as resp,
        ):
            chunks = [
                orjson.loads(line.removeprefix(b"data: "))
                for line in (await resp.read()).splitlines()
                if line.startswith(b"data: {")
            ]
    assert status == 200 and answer["model"] == "sim-llama"
    assert chunks and {chunk["model"] for chunk in chunks} == {"sim-llama"}
