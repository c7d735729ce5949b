"""The TLS nginx template (deploy/nginx/rollout-grpc-tls.conf.template) in front of two replicas
that serve TLS and authenticate callers with tokens, each as its own process.

Checked: trainers reach the fleet over TLS only; nginx re-encrypts to the replicas and forwards the
bearer token unchanged, so the replicas still tell callers apart (a trainer token cannot Pause, no
token is UNAUTHENTICATED); Pause and Resume come only from the admin networks; the replica-internal
ReplicaService is refused at the proxy.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.deploy.streams import PROMPT, params
from tests.security.certs import CertAuthority
from tests.support.processes import (
    REPO,
    Nginx,
    Processes,
    Replica,
    nginx_binary,
    start_engine,
    start_nginx,
    start_replica,
    wait_until,
)

NGINX = nginx_binary()
TLS_TEMPLATE = REPO / "deploy" / "nginx" / "rollout-grpc-tls.conf.template"
TRAINER, ADMIN, PEER = "trainer-secret", "admin-secret", "peer-secret"

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(
        NGINX is None, reason="nginx is not installed (apt-get install nginx-light; .ci/run does it)"
    ),
]


@dataclass
class TlsFleet:
    """One engine, two TLS replicas with tokens, nginx (admins: loopback) and a CA."""

    ca: CertAuthority
    replicas: list[Replica]
    nginx: Nginx
    procs: Processes

    def client(self, token: str | None = None, target: str | None = None) -> AsyncRolloutClient:
        """A TLS client of nginx (or `target`) presenting `token`."""
        return AsyncRolloutClient(
            target or self.nginx.target,
            root_certificates=self.ca.cert_pem,
            token=token,
            server_name="localhost",
        )

    def nginx_with_admins(self, procs: Processes, allow: str) -> Nginx:
        """Another nginx (own prefix in `procs`) over the same replicas, admins only from `allow`."""
        return _start_nginx(procs, self.ca, self.replicas, allow)


def _start_nginx(procs: Processes, ca: CertAuthority, replicas: list[Replica], allow: str) -> Nginx:
    assert NGINX is not None
    server = ca.directory / "server"
    return start_nginx(
        procs,
        NGINX,
        [r.port for r in replicas],
        random.Random(),
        template=TLS_TEMPLATE,
        extra={
            "@TLS_CERT@": f"{server}.crt",
            "@TLS_KEY@": f"{server}.key",
            "@UPSTREAM_CA@": str(ca.cert),
            "@UPSTREAM_NAME@": "localhost",
            "@ADMIN_ALLOW@": allow,
        },
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsFleet]:
    """The TLS deployment, started once for this module and stopped by PID at its end."""
    workdir = tmp_path_factory.mktemp("tls-fleet")
    procs = Processes(workdir)
    pki = workdir / "pki"
    pki.mkdir()
    pki.chmod(0o755)
    ca = CertAuthority(pki)
    ca.issue("rollout-replica", server=True, file_stem="server")
    tokens = pki / "tokens"
    digest = hashlib.sha256(ADMIN.encode()).hexdigest()
    tokens.write_text(f"trainer-1 trainer {TRAINER}\nops admin sha256:{digest}\nfleet peer {PEER}\n")
    args = [
        "--tls-cert",
        str(pki / "server.crt"),
        "--tls-key",
        str(pki / "server.key"),
        "--health-plaintext",
        "--auth-tokens-file",
        str(tokens),
        "--health-interval",
        "0.5",
    ]
    try:
        engine = start_engine(procs, "engine-0", token_delay_ms=1.0)
        replicas = [start_replica(procs, f"replica-{i}", [engine], args) for i in range(2)]
        yield TlsFleet(ca, replicas, _start_nginx(procs, ca, replicas, "allow 127.0.0.1;"), procs)
    finally:
        procs.stop_all()


def _status_lines(nginx: Nginx, method: str) -> list[str]:
    return [line for line in nginx.access_lines() if f"/{method} " in line]


async def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value.code()


async def test_trainer_generates_over_tls_through_nginx(fleet: TlsFleet) -> None:
    async with fleet.client(TRAINER) as trainer:
        sample = await trainer.generate(make_sample(PROMPT), params(4), timeout=60)
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 4
        # The replicas saw the trainer's token (nginx forwarded it): engine URLs stay hidden.
        assert all(a.engine.startswith("engine-") for a in sample.engine_attempts)
    async with fleet.client(None) as anonymous:
        assert await _code(anonymous.server_info(timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
    async with AsyncRolloutClient(fleet.nginx.target) as plaintext:
        assert await _code(plaintext.server_info(timeout=30)) == grpc.StatusCode.UNAVAILABLE


async def test_pause_through_nginx_needs_the_admin_token(fleet: TlsFleet) -> None:
    async with (
        fleet.client(TRAINER) as trainer,
        fleet.client(None) as anonymous,
        fleet.client(ADMIN) as admin,
    ):
        assert await _code(trainer.pause("keep", timeout=30)) == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(anonymous.pause("keep", timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(trainer.resume("attacker-v666", timeout=30)) == grpc.StatusCode.PERMISSION_DENIED
        paused = await admin.pause("keep", timeout=30)
        assert len(paused.paused_engines) == 1 and not paused.engine_errors
        resumed = await admin.resume("v2", timeout=30)
        assert len(resumed.resumed_engines) == 1
        info = await admin.server_info(timeout=30)
        assert info.weight_version == "v2" and not info.paused


async def test_pause_from_outside_the_admin_networks_is_refused_by_nginx(
    fleet: TlsFleet, tmp_path: Path
) -> None:
    procs = Processes(tmp_path)
    try:
        strict = fleet.nginx_with_admins(procs, "allow 192.0.2.0/24;")  # TEST-NET-1, not loopback
        async with fleet.client(ADMIN, strict.target) as admin:
            assert await _code(admin.pause("keep", timeout=30)) == grpc.StatusCode.PERMISSION_DENIED
            assert len((await admin.server_info(timeout=30)).engines) == 1  # other methods pass
        wait_until("nginx access log", lambda: bool(_status_lines(strict, "Pause")), strict.proc)
        assert all(re.search(r" http=403 ", line) for line in _status_lines(strict, "Pause"))
    finally:
        procs.stop_all()


async def test_replica_service_is_not_reachable_through_nginx(fleet: TlsFleet) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=fleet.ca.cert_pem)
    options = [("grpc.ssl_target_name_override", "localhost")]
    async with grpc.aio.secure_channel(fleet.nginx.target, credentials, options=options) as channel:
        stub = pb_grpc.ReplicaServiceStub(channel)
        call = stub.AbortLocal(
            pb.AbortLocalRequest(group_index=0), metadata=(("authorization", f"Bearer {PEER}"),), timeout=30
        )
        assert await _code(call) == grpc.StatusCode.PERMISSION_DENIED
    wait_until("nginx access log", lambda: bool(_status_lines(fleet.nginx, "AbortLocal")), fleet.nginx.proc)
    assert all(" http=403 " in line for line in _status_lines(fleet.nginx, "AbortLocal"))
