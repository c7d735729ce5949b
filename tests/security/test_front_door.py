"""The OpenAI front door behind the gRPC port's security: tokens, TLS/mTLS, caller isolation,
request bounds, per-caller admission, and its metrics and log line. Driven by the official
`openai` client (it sends its `api_key` as `Authorization: Bearer`) and by raw HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from structlog.testing import capture_logs

from rollout_grpc.client import AsyncRolloutClient, make_sample
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.server.security.redact import engine_label
from tests.harness import running_server, sim_engines
from tests.security.certs import CertAuthority
from tests.security.credentials import ADMIN, PEER, TRAINER_A, TRAINER_B, Pki

pytestmark = pytest.mark.timeout(120)

HELLO: list[dict[str, Any]] = [{"role": "user", "content": "Hello there"}]
SHORT: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4}


@contextlib.asynccontextmanager
async def front_door(sim: dict[str, Any] | None = None, **config: Any) -> AsyncIterator[RolloutServer]:
    """A replica on one simulated engine with the front door on a free port."""
    async with (
        sim_engines(1, **(sim or {})) as sims,
        running_server([s.url for s in sims], openai_port=0, **config) as server,
    ):
        yield server


def oai(
    server: RolloutServer, token: str, session: str, *, scheme: str = "http", **client: Any
) -> openai.AsyncOpenAI:
    """The official client on a session of the front door, presenting `token` as its api_key."""
    base = f"{scheme}://127.0.0.1:{server.openai_port}/sessions/{session}/v1"
    return openai.AsyncOpenAI(base_url=base, api_key=token, max_retries=0, **client)


def grpc_client(server: RolloutServer, token: str) -> AsyncRolloutClient:
    return AsyncRolloutClient(f"127.0.0.1:{server.port}", token=token, retry=None)


async def ask(client: openai.AsyncOpenAI, **extra: Any) -> Any:
    completions: Any = client.chat.completions
    return await completions.create(model="", messages=HELLO, **{**SHORT, **extra})


async def test_front_door_needs_a_valid_token_of_a_trainer_or_admin(tokens_file: Path) -> None:
    async with front_door(auth_tokens_file=str(tokens_file)) as server:
        with pytest.raises(openai.AuthenticationError) as err:
            await ask(oai(server, "not-a-token", "s1"))
        assert err.value.status_code == 401
        body: Any = err.value.body
        assert body["message"] == "invalid bearer token" and body["type"] == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            await oai(server, "not-a-token", "s1").models.list()
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await ask(oai(server, PEER, "s1"))
        assert "trainer or admin" in str(denied.value)

        # No Authorization header at all: 401, an OpenAI envelope, and the scheme to use.
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"http://127.0.0.1:{server.openai_port}/v1/chat/completions",
                json={"messages": HELLO, **SHORT},
            ) as reply,
        ):
            assert reply.status == 401
            assert reply.headers["WWW-Authenticate"].startswith("Bearer")
            error = (await reply.json())["error"]
            assert error["code"] == 401 and "credentials required" in error["message"]

        trainer = await ask(oai(server, TRAINER_A, "s1"))
        assert trainer.choices[0].message.content
        admin = await ask(oai(server, ADMIN, "s2"))
        assert admin.usage.completion_tokens == 4


async def test_without_auth_the_front_door_stays_open() -> None:
    async with front_door() as server:
        reply = await ask(oai(server, "anything", "s1"))
        assert reply.usage.completion_tokens == 4


def _trust(pki: Pki, client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    if client_cert:
        context.load_cert_chain(str(pki.alice.cert), str(pki.alice.key))
    return context


async def test_front_door_serves_tls_and_refuses_plaintext(pki: Pki, tokens_file: Path) -> None:
    async with front_door(
        auth_tokens_file=str(tokens_file),
        tls_cert_file=str(pki.server.cert),
        tls_key_file=str(pki.server.key),
    ) as server:
        http = openai.DefaultAsyncHttpxClient(verify=_trust(pki, client_cert=False))
        reply = await ask(oai(server, TRAINER_A, "s1", scheme="https", http_client=http))
        assert reply.usage.completion_tokens == 4
        with pytest.raises(openai.APIConnectionError):
            await ask(oai(server, TRAINER_A, "s2"))  # plaintext to a TLS port
        untrusting = openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context())
        with pytest.raises(openai.APIConnectionError):
            await ask(oai(server, TRAINER_A, "s3", scheme="https", http_client=untrusting))


async def test_front_door_uses_a_rotated_certificate_without_restart(pki: Pki) -> None:
    async with front_door(tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key)) as server:

        def trusting(ca: CertAuthority) -> openai.DefaultAsyncHttpxClient:
            return openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=str(ca.cert)))

        await ask(oai(server, "k", "s1", scheme="https", http_client=trusting(pki.ca)))
        # cert-manager renews the Secret: a pair from another CA replaces the files in place.
        new_ca = CertAuthority(pki.ca.directory, name="rotated-ca")
        renewed = new_ca.issue("rollout-replica", server=True, file_stem="renewed")
        pki.server.key.write_bytes(renewed.key_pem)
        pki.server.cert.write_bytes(renewed.cert_pem)
        reply = await ask(oai(server, "k", "s2", scheme="https", http_client=trusting(new_ca)))
        assert reply.usage.completion_tokens == 4
        with pytest.raises(openai.APIConnectionError):
            await ask(oai(server, "k", "s3", scheme="https", http_client=trusting(pki.ca)))


async def test_front_door_mtls_certificate_is_an_identity(pki: Pki, tokens_file: Path) -> None:
    async with front_door(
        tls_cert_file=str(pki.server.cert),
        tls_key_file=str(pki.server.key),
        tls_client_ca_file=str(pki.ca.cert),
        mtls_roles={"alice.trainers.example": "trainer"},
    ) as server:
        no_cert = openai.DefaultAsyncHttpxClient(verify=_trust(pki, client_cert=False))
        with pytest.raises(openai.APIConnectionError):
            await ask(oai(server, "unused", "s1", scheme="https", http_client=no_cert))
        with_cert = openai.DefaultAsyncHttpxClient(verify=_trust(pki, client_cert=True))
        # The certificate is the credential: without a tokens file the client's placeholder
        # api_key is ignored.
        reply = await ask(oai(server, "placeholder", "s1", scheme="https", http_client=with_cert))
        assert reply.usage.completion_tokens == 4
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"https://127.0.0.1:{server.openai_port}/v1/chat/completions",
                json={"messages": HELLO, **SHORT},
                ssl=_trust(pki, client_cert=True),
            ) as raw,
        ):
            assert raw.status == 200
        async with grpc_client_tls(server, pki) as alice:
            # The session is alice's, on both ports.
            trajectory = await alice.get_trajectory("s1")
            assert len(trajectory.turns) == 1


def grpc_client_tls(server: RolloutServer, pki: Pki) -> AsyncRolloutClient:
    return AsyncRolloutClient(
        f"127.0.0.1:{server.port}",
        root_certificates=pki.ca.cert,
        certificate_chain=pki.alice.cert,
        private_key=pki.alice.key,
        retry=None,
    )


async def test_a_session_belongs_to_its_caller(tokens_file: Path) -> None:
    async with front_door(auth_tokens_file=str(tokens_file)) as server:
        await ask(oai(server, TRAINER_A, "shared-name"))
        with pytest.raises(openai.PermissionDeniedError) as err:
            await ask(oai(server, TRAINER_B, "shared-name"))
        assert "another caller" in str(err.value)
        async with grpc_client(server, TRAINER_B) as b, grpc_client(server, TRAINER_A) as a:
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await b.get_trajectory("shared-name")
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            own = await a.get_trajectory("shared-name")
            assert len(own.turns) == 1
            # Engine addresses are for admins only, in trajectories as in Generate.
            url = server.pool.engines[0].url
            assert [e.engine for e in own.samples[0].engine_attempts] == [engine_label(url)]
        async with grpc_client(server, ADMIN) as admin:
            everything = await admin.get_trajectory("shared-name")
            assert [e.engine for e in everything.samples[0].engine_attempts] == [url]


async def _first_chunk(client: openai.AsyncOpenAI, **extra: Any) -> tuple[str, Any]:
    """Start a streamed turn; its request id (response header) and the open stream."""
    completions: Any = client.chat.completions.with_raw_response
    raw = await completions.create(model="", messages=HELLO, stream=True, **extra)
    stream = raw.parse()
    await stream.__anext__()
    return raw.headers["x-request-id"], stream


async def _finish_reason(stream: Any) -> str | None:
    reason = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    return reason


async def test_only_the_owner_aborts_a_front_door_turn(tokens_file: Path) -> None:
    slow = {"token_delay_s": 0.05}
    async with front_door(slow, auth_tokens_file=str(tokens_file)) as server:
        request_id, stream = await _first_chunk(
            oai(server, TRAINER_A, "long"), temperature=0.0, max_tokens=2000, extra_body={"ignore_eos": True}
        )
        async with grpc_client(server, TRAINER_B) as b, grpc_client(server, TRAINER_A) as a:
            other = await b.abort(request_ids=[request_id])
            assert other.aborted == 0 and list(other.unknown_request_ids) == [request_id]
            own = await a.abort(request_ids=[request_id])
            assert own.aborted == 1
        assert await asyncio.wait_for(_finish_reason(stream), 30) == "abort"


async def test_front_door_requests_obey_the_request_bounds(tokens_file: Path) -> None:
    async with front_door(
        auth_tokens_file=str(tokens_file), max_stop_strings=2, max_chat_template_kwargs_bytes=64
    ) as server:
        client = oai(server, TRAINER_A, "bounded")
        with pytest.raises(openai.BadRequestError) as err:
            await ask(client, stop=["a", "b", "c"])
        assert "max_stop_strings=2" in str(err.value)
        assert isinstance(err.value.body, dict) and err.value.body["param"] == "stop"
        with pytest.raises(openai.BadRequestError) as err:
            await ask(client, stop=["x" * 2000])
        assert "max_stop_string_chars" in str(err.value)
        with pytest.raises(openai.BadRequestError) as err:
            await ask(client, extra_body={"chat_template_kwargs": {"k": "v" * 100}})
        assert isinstance(err.value.body, dict) and err.value.body["param"] == "chat_template_kwargs"


async def test_a_caller_over_its_share_is_refused_and_others_still_served(tokens_file: Path) -> None:
    slow = {"token_delay_s": 0.05}
    async with front_door(slow, auth_tokens_file=str(tokens_file), max_in_flight_per_caller=1) as server:
        _, stream = await _first_chunk(
            oai(server, TRAINER_A, "one"), temperature=0.0, max_tokens=2000, extra_body={"ignore_eos": True}
        )
        with pytest.raises(openai.RateLimitError) as err:
            await ask(oai(server, TRAINER_A, "two"))
        assert "max_in_flight_per_caller=1" in str(err.value)
        reply = await ask(oai(server, TRAINER_B, "three"))
        assert reply.usage.completion_tokens == 4
        async with grpc_client(server, TRAINER_A) as a:
            assert (await a.abort(session_id="one")).aborted == 1
        assert await asyncio.wait_for(_finish_reason(stream), 30) == "abort"


async def test_every_front_door_request_is_counted_and_logged(tokens_file: Path) -> None:
    async with front_door(auth_tokens_file=str(tokens_file)) as server:
        with capture_logs() as logs:
            reply = await ask(oai(server, TRAINER_A, "observed"))
            request_id, stream = await _first_chunk(oai(server, TRAINER_A, "observed"), **SHORT)
            assert await _finish_reason(stream) == "length"
            with pytest.raises(openai.AuthenticationError):
                await ask(oai(server, "bad", "observed"))
            await oai(server, TRAINER_A, "x").models.list()
        done = [e for e in logs if e.get("event") == "openai_done"]
        assert [(e["route"], e["code"]) for e in done] == [
            ("/v1/chat/completions", 200),
            ("/v1/chat/completions", 200),
            ("/v1/chat/completions", 401),
            ("/v1/models", 200),
        ]
        first, streamed, refused = done[0], done[1], done[2]
        assert first["caller"] == "trainer-a" and first["session_id"] == "observed"
        assert first["request_id"] == reply.id.removeprefix("chatcmpl-")
        assert first["new_tokens"] == 4 and first["finish"] == "LENGTH" and first["ttft_ms"] is not None
        assert streamed["request_id"] == request_id and streamed["stream"] is True
        assert streamed["queue_wait_ms"] is not None
        assert refused["caller"] is None and refused["error"] == "invalid bearer token"

        text = server.metrics.exposition().decode()
        assert 'rollout_grpc_openai_requests_total{code="200",route="/v1/chat/completions"} 2.0' in text
        assert 'rollout_grpc_openai_requests_total{code="401",route="/v1/chat/completions"} 1.0' in text
        assert "rollout_grpc_openai_time_to_first_token_seconds_count 2.0" in text
        assert "rollout_grpc_openai_generation_tokens_total 8.0" in text


async def test_grpc_generate_still_works_next_to_the_front_door(tokens_file: Path) -> None:
    async with front_door(auth_tokens_file=str(tokens_file)) as server, grpc_client(server, TRAINER_A) as a:
        sample = await a.generate(make_sample([1, 2, 3]), {"temperature": 0, "max_new_tokens": 2})
        assert sample.response_length == 2
