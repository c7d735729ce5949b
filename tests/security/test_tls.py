"""TLS and mTLS on the gRPC and health ports, with both Python clients and certificate reload."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc.client import AsyncRolloutClient, RolloutClient, make_sample, pb
from rollout_grpc.server.app import RolloutServer
from tests.harness import running_server, sim_engines
from tests.security.certs import CertAuthority
from tests.security.credentials import Pki
from tests.support.service import PROMPT

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
#: Deadline of the calls here, a safety net and not the bound under test: a served call answers at
#: once, and a refused handshake is UNAVAILABLE. The clients that are to be refused run without the
#: default retry policy: with it, gRPC tried the handshake 5 times with backoff and the call took
#: 2.7-3.2 s at load 7 (measured), under the 5 s deadline these calls had, so a loaded machine read
#: DEADLINE_EXCEEDED instead of the UNAVAILABLE under test.
CALL_S = 30.0


def _target(server: RolloutServer) -> str:
    return f"127.0.0.1:{server.port}"


async def test_tls_serves_and_plaintext_is_refused(pki: Pki) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims], tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key)
        ) as server,
    ):
        async with AsyncRolloutClient(_target(server), root_certificates=pki.ca.cert) as client:
            sample = await client.generate(make_sample(PROMPT), GREEDY)
            assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 4

        async with AsyncRolloutClient(_target(server), retry=None) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await plaintext.server_info(timeout=CALL_S)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        # A client that does not trust the server's CA refuses the connection.
        other_ca = CertAuthority(pki.ca.directory, name="someone-else")
        async with AsyncRolloutClient(
            _target(server), root_certificates=other_ca.cert, retry=None
        ) as untrusting:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await untrusting.server_info(timeout=CALL_S)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        # The health port speaks TLS too.
        assert server.health_port is not None
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem)
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.health_port}", credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_mtls_requires_a_client_certificate(pki: Pki) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims],
            tls_cert_file=str(pki.server.cert),
            tls_key_file=str(pki.server.key),
            tls_client_ca_file=str(pki.ca.cert),
        ) as server,
    ):
        async with AsyncRolloutClient(
            _target(server), root_certificates=pki.ca.cert, retry=None
        ) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await anonymous.server_info(timeout=CALL_S)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        async with AsyncRolloutClient(
            _target(server),
            root_certificates=pki.ca.cert,
            certificate_chain=pki.alice.cert,
            private_key=pki.alice.key,
        ) as client:
            sample = await client.generate(make_sample(PROMPT), GREEDY)
            assert sample.response_length == 4

        # The blocking client takes the same options (run off the event loop).
        def blocking_call() -> pb.GetServerInfoResponse:
            with RolloutClient(
                _target(server),
                root_certificates=pki.ca.cert_pem,
                certificate_chain=pki.alice.cert_pem,
                private_key=pki.alice.key_pem,
            ) as sync_client:
                return sync_client.server_info(timeout=CALL_S)

        info = await asyncio.to_thread(blocking_call)
        assert len(info.engines) == 1

        # Probes have no client certificate: the health port serves TLS without asking for one.
        assert server.health_port is not None
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem)
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.health_port}", credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_rotated_certificate_is_used_by_new_connections_without_restart(pki: Pki) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims], tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key)
        ) as server,
    ):
        async with AsyncRolloutClient(_target(server), root_certificates=pki.ca.cert_pem) as before:
            await before.server_info(timeout=CALL_S)

        # cert-manager renews the Secret: a new CA-signed pair replaces the files in place.
        new_ca = CertAuthority(pki.ca.directory, name="rotated-ca")
        renewed = new_ca.issue("rollout-replica", server=True, file_stem="renewed")
        pki.server.key.write_bytes(renewed.key_pem)
        pki.server.cert.write_bytes(renewed.cert_pem)

        async with AsyncRolloutClient(_target(server), root_certificates=new_ca.cert_pem) as after:
            info = await after.server_info(timeout=CALL_S)
            assert len(info.engines) == 1
        async with AsyncRolloutClient(
            _target(server), root_certificates=pki.ca.cert_pem, retry=None
        ) as stale:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stale.server_info(timeout=CALL_S)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_half_written_certificate_keeps_the_previous_one(pki: Pki) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims], tls_cert_file=str(pki.server.cert), tls_key_file=str(pki.server.key)
        ) as server,
    ):
        pki.server.cert.write_bytes(b"not yet")
        async with AsyncRolloutClient(_target(server), root_certificates=pki.ca.cert_pem) as client:
            info = await client.server_info(timeout=CALL_S)
            assert len(info.engines) == 1
