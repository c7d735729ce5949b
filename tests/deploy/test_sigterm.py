"""SIGTERM on a replica with generations in flight (what Kubernetes does at every rollout).

The replica runs as its own process (`rollout-grpc serve --grace G`) on a slow simulated engine.
After SIGTERM it must: go NOT_SERVING on its health port, refuse new Generate calls with
UNAVAILABLE (so trainers retry elsewhere), let generations that fit in the grace finish, end the
others as ABORTED samples that keep every streamed token, deliver every final sample, and exit 0.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc.client import AsyncRolloutClient, make_sample
from rollout_grpc.server.app import ServerConfig
from tests.deploy.streams import (
    PROMPT,
    SERVICE,
    WAIT_S,
    assert_aborted,
    assert_finished,
    params,
    start_stream,
    started,
)
from tests.support.processes import Engine, Processes, Replica, start_engine, start_replica

#: 10 ms per token: SHORT streams need ~0.4 s (a tenth of the grace), LONG ones ~30 s (far more).
TOKEN_DELAY_MS = 10.0
SHORT = 40
LONG = 3000
GRACE_S = 4.0
#: The replica's own bound from SIGTERM to exit (rollout_grpc/server/domain/bounds.py), the one
#: deploy/k8s is checked against. Exceeding it means it hung.
EXIT_BOUND_S = ServerConfig(engines=[], grace_s=GRACE_S).shutdown_bound_s()


@pytest.fixture
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Processes]]:
    """One slow engine and one replica in front of it; every process stopped by PID at the end."""
    procs = Processes(tmp_path_factory.mktemp("sigterm"))
    try:
        engine: Engine = start_engine(procs, "engine", token_delay_ms=TOKEN_DELAY_MS)
        yield start_replica(procs, "replica", [engine], ["--grace", str(GRACE_S)]), procs
    finally:
        procs.stop_all()


async def test_sigterm_delivers_every_sample_refuses_new_calls_and_exits_zero(
    replica: tuple[Replica, Processes],
) -> None:
    server, _ = replica
    async with (
        AsyncRolloutClient(server.target, retry=None) as client,  # the refusal itself is under test
        grpc.aio.insecure_channel(server.health_target) as health_channel,
    ):
        short = [start_stream(client, f"short-{i}", SHORT) for i in range(8)]
        long = [start_stream(client, f"long-{i}", LONG) for i in range(24)]
        await started(*short, *long)

        watch = health_pb2_grpc.HealthStub(health_channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=WAIT_S
        )
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING

        server.proc.popen.send_signal(signal.SIGTERM)

        # Readiness drops at once (the signal for load balancers and Kubernetes endpoints) ...
        changed = await watch.read()
        assert changed.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        # ... and from then on new work is refused, never served. On a connection opened before
        # the shutdown, gRPC core cancels a call that arrives between its two GOAWAY frames
        # (CANCELLED, the handler never runs); later calls find the listener closed (UNAVAILABLE).
        # Through a proxy the refused connection sends the call to another replica
        # (test_nginx.py::test_calls_during_a_replicas_drain_succeed_on_the_other_replica).
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate(make_sample(PROMPT), params(4), timeout=WAIT_S)
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), refused.value

        # Every caller gets its final sample: short ones finish within the grace, long ones are
        # aborted when it runs out, keeping exactly the tokens they streamed.
        for stream in short:
            assert_finished(stream, await stream.final())
        for stream in long:
            assert_aborted(stream, await stream.final())

    code = await asyncio.to_thread(server.proc.popen.wait, EXIT_BOUND_S)
    assert code == 0, server.proc.describe_exit()
    # The long streams outlived the grace: the replica waited for it, then aborted exactly them.
    record = server.log_events("shutdown_aborting")
    assert [r.get("generations") for r in record] == [len(long)]
