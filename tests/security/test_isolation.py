"""Callers are isolated: an Abort reaches only the caller's own generations, across replicas too."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.server.app import RolloutServer
from tests.harness import running_server, sim_engines
from tests.security.credentials import ADMIN, PEER, TRAINER_A, TRAINER_B, Pki
from tests.support.service import LONG, PROMPT, SLOW_SIM, assert_lossless, start_stream, started

SHORT = {**LONG, "max_new_tokens": 300}


@contextlib.asynccontextmanager
async def two_replicas(tokens: Path, tmp_path: Path) -> AsyncIterator[tuple[RolloutServer, RolloutServer]]:
    """Replicas R1 and R2 on the same slow engine, each the other's authenticated peer."""
    peer_token = tmp_path / "peer-token"
    peer_token.write_text(PEER + "\n")
    async with sim_engines(1, **SLOW_SIM) as sims:
        urls = [s.url for s in sims]
        secured: dict[str, object] = {"auth_tokens_file": str(tokens), "peer_token_file": str(peer_token)}
        async with (
            running_server(urls, **secured) as r1,
            running_server(urls, peers=[f"127.0.0.1:{r1.port}"], **secured) as r2,
        ):
            yield r1, r2


def client(server: RolloutServer, token: str) -> AsyncRolloutClient:
    """A loopback client of `server` presenting `token`."""
    return AsyncRolloutClient(f"127.0.0.1:{server.port}", token=token)


async def test_another_trainer_cannot_abort_by_id_session_or_group(tokens_file: Path) -> None:
    async with (
        sim_engines(1, **SLOW_SIM) as sims,
        running_server([s.url for s in sims], auth_tokens_file=str(tokens_file)) as server,
        client(server, TRAINER_A) as a,
        client(server, TRAINER_B) as b,
        client(server, ADMIN) as admin,
    ):
        # The victim never set a group: group 0, the proto default.
        victim = start_stream(a, "victim", SHORT, sample=make_sample(PROMPT, session_id="sess"))
        mine = start_stream(b, "b-own", sample=make_sample(PROMPT, session_id="sess"))
        await started(victim, mine)

        by_id = await b.abort(request_ids=["victim"])
        assert by_id.aborted == 0 and list(by_id.unknown_request_ids) == ["victim"]
        assert (await b.abort(session_id="sess")).aborted == 1  # only B's own
        assert (await mine.task).status == pb.SAMPLE_STATUS_ABORTED
        assert (await b.abort(group_index=0)).aborted == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await b.abort(all=True)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

        finished = await victim.task
        assert finished.status == pb.SAMPLE_STATUS_TRUNCATED and finished.response_length == 300
        assert_lossless(victim, finished)

        # The owner and the admin may abort it.
        again = start_stream(a, "victim-2")
        other = start_stream(b, "b-2")
        await started(again, other)
        assert (await a.abort(request_ids=["victim-2", "b-2"])).aborted == 1
        assert (await again.task).status == pb.SAMPLE_STATUS_ABORTED
        assert (await admin.abort(request_ids=["b-2"])).aborted == 1
        assert (await other.task).status == pb.SAMPLE_STATUS_ABORTED


async def test_isolation_holds_across_replicas(tokens_file: Path, tmp_path: Path) -> None:
    async with (
        two_replicas(tokens_file, tmp_path) as (r1, r2),
        client(r1, TRAINER_A) as a1,
        client(r2, TRAINER_A) as a2,
        client(r2, TRAINER_B) as b2,
    ):
        victim = start_stream(a1, "a-far", sample=make_sample(PROMPT, session_id="s", group_index=3))
        await started(victim)
        # B, on the other replica, reaches nothing of A's: not by id, session or group.
        foreign = await b2.abort(request_ids=["a-far"])
        # Another caller's id is unknown on the peer too: its existence is not disclosed.
        assert foreign.aborted == 0 and list(foreign.unknown_request_ids) == ["a-far"]
        assert (await b2.abort(session_id="s")).aborted == 0
        assert (await b2.abort(group_index=3)).aborted == 0
        assert not victim.task.done()
        # A reaches its own generation on R1 through R2, by id.
        response = await a2.abort(request_ids=["a-far"])
        assert response.aborted == 1 and not response.unknown_request_ids  # the peer knew it
        sample = await victim.task
        assert sample.status == pb.SAMPLE_STATUS_ABORTED
        assert_lossless(victim, sample)

        by_session = start_stream(a1, "a-sess", sample=make_sample(PROMPT, session_id="s2"))
        await started(by_session)
        assert (await a2.abort(session_id="s2")).aborted == 1
        assert (await by_session.task).status == pb.SAMPLE_STATUS_ABORTED


async def test_replica_service_refuses_trainers(tokens_file: Path) -> None:
    async with (
        sim_engines(1) as sims,
        running_server([s.url for s in sims], auth_tokens_file=str(tokens_file)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.ReplicaServiceStub(channel)
        request = pb.AbortLocalRequest(owner="", group_index=0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.AbortLocal(request, metadata=(("authorization", f"Bearer {TRAINER_A}"),))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        reply = await stub.AbortLocal(request, metadata=(("authorization", f"Bearer {PEER}"),))
        assert reply.aborted == 0


@pytest.mark.parametrize("peer_tls_name", ["rollout-grpc-headless", None])
async def test_forwarded_aborts_travel_over_mtls_with_a_verified_peer_name(
    pki: Pki, peer_tls_name: str | None
) -> None:
    """Peers are dialed by IP, which their certificate does not name: --peer-tls-name says which
    name to verify; each replica presents its own certificate, mapped to the peer role."""
    replica_cert = pki.ca.issue(
        "rollout-replica", server=True, file_stem="replica", dns_names=["rollout-grpc-headless"]
    )
    tls: dict[str, object] = {
        "tls_cert_file": str(replica_cert.cert),
        "tls_key_file": str(replica_cert.key),
        "tls_client_ca_file": str(pki.ca.cert),
        "mtls_roles": {"rollout-grpc-headless": "peer", "alice.trainers.example": "trainer"},
        "peer_tls_name": peer_tls_name,
    }
    async with (
        sim_engines(1, **SLOW_SIM) as sims,
        running_server([s.url for s in sims], **tls) as r1,
        running_server([s.url for s in sims], peers=[f"127.0.0.1:{r1.port}"], **tls) as r2,
    ):

        def alice(server: RolloutServer) -> AsyncRolloutClient:
            return AsyncRolloutClient(
                f"127.0.0.1:{server.port}",
                root_certificates=pki.ca.cert,
                certificate_chain=pki.alice.cert,
                private_key=pki.alice.key,
                server_name="rollout-grpc-headless",
            )

        async with alice(r1) as a1, alice(r2) as a2:
            far = start_stream(
                a1, "far", {**LONG, "max_new_tokens": 200}, sample=make_sample(PROMPT, session_id="t")
            )
            await started(far)
            reached = (await a2.abort(session_id="t")).aborted
            sample = await far.task
        if peer_tls_name is None:  # the peer's certificate does not name 127.0.0.1: not reached
            assert reached == 0 and sample.status == pb.SAMPLE_STATUS_TRUNCATED
        else:
            assert reached == 1 and sample.status == pb.SAMPLE_STATUS_ABORTED
