"""Bearer tokens and mTLS identities, roles, redaction of engine URLs, reload and the audit log."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.server.security.auth import TokenFileError, TokenStore, parse_tokens
from rollout_grpc.server.security.redact import engine_label
from tests.harness import running_server, sim_engines
from tests.security.credentials import ADMIN, PEER, TRAINER_A, Pki
from tests.support.service import PROMPT

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@contextlib.asynccontextmanager
async def authed_server(tokens: Path, **config: Any) -> AsyncIterator[RolloutServer]:
    """A replica with the tokens file, on one simulated engine."""
    async with (
        sim_engines(1) as sims,
        running_server([s.url for s in sims], auth_tokens_file=str(tokens), **config) as server,
    ):
        yield server


def client(server: RolloutServer, token: str | None = None) -> AsyncRolloutClient:
    """A plaintext loopback client presenting `token`."""
    return AsyncRolloutClient(f"127.0.0.1:{server.port}", token=token)


async def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


async def test_no_or_bad_credentials_are_unauthenticated(tokens_file: Path) -> None:
    async with authed_server(tokens_file) as server:
        async with client(server) as anonymous:
            assert await _code(anonymous.server_info()) == grpc.StatusCode.UNAUTHENTICATED
            assert (
                await _code(anonymous.generate(make_sample(PROMPT), GREEDY))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            assert await _code(anonymous.pause("keep")) == grpc.StatusCode.UNAUTHENTICATED
        async with client(server, "not-a-token") as forger:
            assert await _code(forger.server_info()) == grpc.StatusCode.UNAUTHENTICATED
        # A Basic header is not a bearer token.
        async with client(server) as raw:
            call = raw.stub.GetServerInfo(
                pb.GetServerInfoRequest(), metadata=(("authorization", "Basic eA=="),)
            )
            assert await _code(call) == grpc.StatusCode.UNAUTHENTICATED


async def test_trainer_generates_but_may_not_pause_resume_or_abort_all(tokens_file: Path) -> None:
    async with authed_server(tokens_file) as server, client(server, TRAINER_A) as trainer:
        sample = await trainer.generate(make_sample(PROMPT), GREEDY)
        assert sample.response_length == 4
        # Engine URLs are hidden from trainers, in the sample as in the server info.
        url = server.pool.engines[0].url
        assert [a.engine for a in sample.engine_attempts] == [engine_label(url)]
        info = await trainer.server_info()
        assert [e.url for e in info.engines] == [engine_label(url)]
        assert url not in str(info)

        assert await _code(trainer.pause("keep")) == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(trainer.resume("attacker-v666")) == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(trainer.abort(all=True)) == grpc.StatusCode.PERMISSION_DENIED
        # Nothing was relabelled: the engine still carries its own weight version.
        assert server.pool.engines[0].weight_version != "attacker-v666"


async def test_admin_pauses_resumes_and_sees_engine_urls(tokens_file: Path) -> None:
    async with authed_server(tokens_file) as server, client(server, ADMIN) as admin:
        assert list((await admin.pause("keep")).paused_engines) == [server.pool.engines[0].url]
        assert list((await admin.resume("v2")).resumed_engines) == [server.pool.engines[0].url]
        info = await admin.server_info()
        assert [e.url for e in info.engines] == [server.pool.engines[0].url]
        assert info.weight_version == "v2"
        assert (await admin.abort(all=True)).aborted == 0


async def test_peer_role_may_only_forward_aborts(tokens_file: Path) -> None:
    async with authed_server(tokens_file) as server, client(server, PEER) as peer:
        assert await _code(peer.server_info()) == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(peer.generate(make_sample(PROMPT), GREEDY)) == grpc.StatusCode.PERMISSION_DENIED


async def test_health_stays_open_and_reflection_needs_credentials(tokens_file: Path) -> None:
    async with (
        authed_server(tokens_file) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.ServerReflectionInfo(iter([request])):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = [
            r
            async for r in stub.ServerReflectionInfo(
                iter([request]), metadata=(("authorization", f"Bearer {TRAINER_A}"),)
            )
        ]
        names = {s.name for s in replies[0].list_services_response.service}
        assert "rollout.v1.RolloutService" in names


async def test_tokens_file_is_reloaded_when_it_changes(tokens_file: Path) -> None:
    async with authed_server(tokens_file) as server:
        server.auth.tokens._check_interval_s = 0.0  # type: ignore[union-attr]
        async with client(server, "rotated-token") as newcomer:
            assert await _code(newcomer.server_info()) == grpc.StatusCode.UNAUTHENTICATED
            tokens_file.write_text(tokens_file.read_text() + "trainer-c trainer rotated-token\n")
            assert len((await newcomer.server_info()).engines) == 1
        # A broken file keeps the tokens that worked.
        tokens_file.write_text("garbage\n")
        async with client(server, TRAINER_A) as trainer:
            assert len((await trainer.server_info()).engines) == 1


def test_token_file_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match=r"tokens:2: unknown role 'root'"):
        parse_tokens("a trainer t\nb root t\n")
    with pytest.raises(TokenFileError, match=r"tokens:1: sha256: needs 64 hex digits"):
        parse_tokens("a admin sha256:abcd\n")
    path = tmp_path / "t"
    path.write_text("a trainer secret # comment\n\n")
    store = TokenStore(path)
    assert store.authenticate("secret") is not None
    assert store.authenticate("secreT") is None


async def test_mtls_certificate_names_map_to_roles(pki: Pki) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims],
            tls_cert_file=str(pki.server.cert),
            tls_key_file=str(pki.server.key),
            tls_client_ca_file=str(pki.ca.cert),
            mtls_roles={"alice.trainers.example": "trainer", "ops.admins.example": "admin"},
        ) as server,
    ):
        target = f"127.0.0.1:{server.port}"

        def connect(who: Any) -> AsyncRolloutClient:
            return AsyncRolloutClient(
                target, root_certificates=pki.ca.cert, certificate_chain=who.cert, private_key=who.key
            )

        async with connect(pki.alice) as alice, connect(pki.ops) as ops:
            assert (await alice.generate(make_sample(PROMPT), GREEDY)).response_length == 4
            assert await _code(alice.pause("keep")) == grpc.StatusCode.PERMISSION_DENIED
            assert len((await ops.pause("keep")).paused_engines) == 1
            await ops.resume()
        stranger = pki.ca.issue("mallory.example", server=False)
        async with connect(stranger) as mallory:
            assert await _code(mallory.server_info()) == grpc.StatusCode.PERMISSION_DENIED


async def test_every_control_rpc_is_audited_with_caller_target_and_outcome(tokens_file: Path) -> None:
    async with (
        authed_server(tokens_file) as server,
        client(server, TRAINER_A) as trainer,
        client(server, ADMIN) as admin,
    ):
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(grpc.aio.AioRpcError):
                await trainer.pause("keep")
            await admin.resume("v7")
            await trainer.abort(session_id="s-1")
        audit = [entry for entry in logs if entry["event"] == "audit"]
        assert [(a["method"].rsplit("/", 1)[-1], a["caller"], a["outcome"]) for a in audit] == [
            ("Pause", "trainer-a", "PERMISSION_DENIED"),
            ("Resume", "ops", "OK"),
            ("Abort", "trainer-a", "OK"),
        ]
        assert audit[0]["mode"] == "PAUSE_MODE_KEEP"
        assert audit[1]["weight_version"] == "v7"
        assert audit[2]["target"] == "session_id" and audit[2]["session_id"] == "s-1"


async def test_audit_without_auth_names_the_anonymous_caller() -> None:
    async with sim_engines(1) as sims, running_server([s.url for s in sims]) as server:
        async with client(server) as anyone:
            with structlog.testing.capture_logs() as logs:
                await anyone.abort(request_ids=["nothing"])
        audit = [entry for entry in logs if entry["event"] == "audit"]
        assert len(audit) == 1 and audit[0]["caller"] == "anonymous" and audit[0]["outcome"] == "OK"
