"""Two replicas behind nginx (deploy/nginx/rollout-grpc.conf.template), as deployed.

Simulated engines, `rollout-grpc serve` replicas and nginx each run as their own process; the
test talks to nginx only, except where it asks a replica directly who is serving what. It checks
what the config is for: calls are balanced per call over both replicas on one client channel,
streams are passed through incrementally, the fleet-wide controls (Abort all through the engines,
Abort by id through the replicas' peers) reach streams on whichever replica serves them, health
answers through the proxy, and a request larger than nginx's default body limit reaches a replica.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.deploy.streams import (
    PROMPT,
    SERVICE,
    assert_aborted,
    assert_finished,
    assert_lossless,
    health_status,
    params,
    start_stream,
    started,
)
from tests.support.processes import (
    LOOPBACK,
    POLL_S,
    Engine,
    Nginx,
    Processes,
    Replica,
    free_ports,
    nginx_binary,
    start_engine,
    start_nginx,
    start_replica,
    wait_until,
)

NGINX = nginx_binary()

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(
        NGINX is None, reason="nginx is not installed (apt-get install nginx-light; .ci/run does it)"
    ),
]

#: Per-token delay of the simulated engines: a 3000-token stream runs ~15 s, far longer than any
#: test needs it in flight; 200 tokens take ~1 s.
TOKEN_DELAY_MS = 5.0
LONG = 3000
#: How long a replica may take to write a Generate's log line after its final sample.
LOG_LINE_TIMEOUT_S = 10.0


@dataclass
class Fleet:
    """Two engines, two replicas using both, nginx in front of the replicas."""

    engines: list[Engine]
    replicas: list[Replica]
    nginx: Nginx

    def replica_serving(self, request_id: str) -> list[int]:
        """Indexes of the replicas whose logs record the generation `request_id`.

        A replica writes a Generate's `generate_done` line when the call ends, which may be just
        after the caller received the final sample: wait (bounded) for a line to appear.
        """

        def serving() -> list[int]:
            return [
                i
                for i, replica in enumerate(self.replicas)
                if any(r.get("request_id") == request_id for r in replica.log_events("generate_done"))
            ]

        deadline = time.monotonic() + LOG_LINE_TIMEOUT_S
        while not (found := serving()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return found


def start_fleet(procs: Processes, engines: int, replica_args: list[str]) -> Fleet:
    """`engines` simulated engines, two replicas using all of them and each the other's `--peer`
    (an Abort by id reaches the other replica's generations through it), nginx in front."""
    assert NGINX is not None
    sims = [start_engine(procs, f"engine-{i}", token_delay_ms=TOKEN_DELAY_MS, seed=i) for i in range(engines)]
    ports = free_ports(2)
    replicas = [
        start_replica(
            procs,
            f"replica-{i}",
            sims,
            [
                "--health-interval",
                "0.5",
                "--port",
                str(port),
                "--peer",
                f"{LOOPBACK}:{ports[1 - i]}",
                *replica_args,
            ],
        )
        for i, port in enumerate(ports)
    ]
    nginx = start_nginx(procs, NGINX, [r.port for r in replicas], random.Random())
    return Fleet(sims, replicas, nginx)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The whole deployment, started once for this module and stopped by PID at its end."""
    procs = Processes(tmp_path_factory.mktemp("fleet"))
    try:
        yield start_fleet(procs, 2, [])
    finally:
        procs.stop_all()


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[AsyncRolloutClient]:
    """One client channel to nginx (one HTTP/2 connection, as a trainer would hold)."""
    async with AsyncRolloutClient(fleet.nginx.target) as c:
        yield c


ACCESS_LINE = re.compile(
    r" (?P<uri>/\S+) http=(?P<http>\d+) grpc-status=(?P<grpc>\S+) upstream=(?P<upstream>\S+) "
)


def generate_calls(nginx: Nginx) -> list[re.Match[str]]:
    """Access-log entries of Generate calls."""
    matches = (ACCESS_LINE.search(line) for line in nginx.access_lines())
    return [m for m in matches if m and m["uri"].endswith("/Generate")]


async def test_health_check_through_nginx_and_on_each_replica(fleet: Fleet) -> None:
    # Through the balancer a Check answers for whichever replica nginx picked ...
    assert await health_status(fleet.nginx.target, "") == health_pb2.HealthCheckResponse.SERVING
    assert await health_status(fleet.nginx.target, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    # ... so probes (Kubernetes) go to each replica's own health port.
    for replica in fleet.replicas:
        assert await health_status(replica.health_target, SERVICE) == health_pb2.HealthCheckResponse.SERVING


async def test_generates_complete_and_are_spread_over_both_replicas(
    fleet: Fleet, client: AsyncRolloutClient
) -> None:
    before = len(generate_calls(fleet.nginx))
    ids = [f"spread-{i}" for i in range(10)]
    for request_id in ids:  # sequential calls on one channel: an L4 balancer would pin them all
        sample = await client.generate(make_sample(PROMPT), params(8), request_id=request_id, timeout=60)
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 8
    # Each replica logs every Generate that ends: exactly one served each call.
    served = [fleet.replica_serving(request_id) for request_id in ids]
    assert all(len(s) == 1 for s in served), served
    assert {s[0] for s in served} == {0, 1}, served
    # nginx's view: one access-log line per call (written just after the call ends), OK status,
    # upstreams = both replicas.
    wait_until(
        "nginx access log", lambda: len(generate_calls(fleet.nginx)) >= before + len(ids), fleet.nginx.proc
    )
    calls = generate_calls(fleet.nginx)[before:]
    assert [(m["http"], m["grpc"]) for m in calls] == [("200", "0")] * len(ids)
    assert {m["upstream"] for m in calls} == {r.target for r in fleet.replicas}


async def test_stream_is_passed_through_incrementally(fleet: Fleet, client: AsyncRolloutClient) -> None:
    stream = start_stream(client, "incremental", LONG)
    await started(stream)
    # The first token reached the caller while its generation still runs on a replica: nginx
    # passes gRPC messages on as they come (grpc_pass does not buffer responses).
    async with (
        AsyncRolloutClient(fleet.replicas[0].target) as a,
        AsyncRolloutClient(fleet.replicas[1].target) as b,
    ):
        assert (await a.server_info()).in_flight + (await b.server_info()).in_flight == 1
    await client.abort(request_ids=["incremental"])
    sample = await stream.final()
    assert_aborted(stream, sample)
    assert stream.deltas == sample.response_length  # one message per token, none merged or lost


async def test_abort_all_through_nginx_ends_streams_on_both_replicas(
    fleet: Fleet, client: AsyncRolloutClient
) -> None:
    streams = [start_stream(client, f"all-{i}", LONG) for i in range(8)]
    await started(*streams)
    direct = [AsyncRolloutClient(r.target) for r in fleet.replicas]
    try:
        in_flight = [(await c.server_info()).in_flight for c in direct]
        # least_conn put streams on both replicas, even though they share one client connection.
        assert sum(in_flight) == len(streams) and min(in_flight) >= 1, in_flight

        response = await client.abort(all=True)
        # One replica answered (it counts its own streams); the engines ended the other's too.
        assert response.aborted in in_flight, (response.aborted, in_flight)
        assert not response.engine_errors
        for stream in streams:
            assert_aborted(stream, await stream.final())

        # The engines were resumed: new work completes, and no replica reports paused engines.
        after = await client.generate(make_sample(PROMPT), params(4), timeout=60)
        assert after.status == pb.SAMPLE_STATUS_TRUNCATED and after.response_length == 4
        for c in direct:
            info = await c.server_info()
            assert not info.paused and info.in_flight == 0
    finally:
        await asyncio.gather(*(c.close() for c in direct))


async def test_abort_by_id_through_nginx_reaches_either_replica(
    fleet: Fleet, client: AsyncRolloutClient
) -> None:
    # least_conn sends the second call to the replica without an active call: the victims sit on
    # different replicas, so whichever replica receives the Abort, one victim is not its own.
    victim_a = start_stream(client, "victim-a", LONG)
    await started(victim_a)
    victim_b = start_stream(client, "victim-b", LONG)
    await started(victim_b)
    bystander = start_stream(client, "bystander", 200)
    await started(bystander)

    response = await client.abort(request_ids=["victim-a", "victim-b"])
    assert response.aborted == 2, response  # one on the receiving replica, one through its peer
    assert not response.unknown_request_ids, response  # the peer reported the id it knew
    assert not response.engine_errors

    for victim in (victim_a, victim_b):
        assert_aborted(victim, await victim.final())
    assert_finished(bystander, await bystander.final())
    assert sorted(fleet.replica_serving("victim-a") + fleet.replica_serving("victim-b")) == [0, 1]


async def test_request_larger_than_nginx_default_body_limit_reaches_a_replica(
    client: AsyncRolloutClient,
) -> None:
    # 2 MB of token ids (ids >= 128 take two bytes as varints): nginx's default
    # client_max_body_size (1m) would answer 413, which a gRPC client sees as INTERNAL. With 64m
    # it reaches a replica, which judges the prompt itself (longer than the engine's 4096-token
    # context: INVALID_ARGUMENT naming the field).
    huge = make_sample([1000] * 1_000_000)
    assert huge.ByteSize() > 2_000_000
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.generate(huge, params(2), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert (info.value.details() or "").startswith("sample.tokens")


async def test_every_stream_is_lossless_when_many_run_concurrently(client: AsyncRolloutClient) -> None:
    streams = [start_stream(client, f"many-{i}", 100) for i in range(64)]
    for stream in streams:
        sample = await stream.final()
        assert_finished(stream, sample)
        assert_lossless(stream, sample)


DRAIN_GRACE_S = 3.0


@pytest.fixture
def draining_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet of its own (one replica gets SIGTERM), replicas with a short --grace."""
    procs = Processes(tmp_path_factory.mktemp("drain"))
    try:
        # Two worker processes per replica (whatever the machine's cores): the leaving replica's
        # health port says NOT_SERVING only once both workers stopped accepting (docs/workers.md,
        # "Drain"), so no call made after it reaches the leaving replica.
        yield start_fleet(procs, 1, ["--grace", str(DRAIN_GRACE_S), "--workers", "2"])
    finally:
        procs.stop_all()


async def test_calls_during_a_replicas_drain_succeed_on_the_other_replica(
    draining_fleet: Fleet,
) -> None:
    fleet = draining_fleet
    leaving, staying = fleet.replicas
    async with AsyncRolloutClient(fleet.nginx.target) as client:
        streams = [start_stream(client, f"drain-{i}", LONG) for i in range(4)]
        await started(*streams)
        async with AsyncRolloutClient(leaving.target) as direct:
            assert (await direct.server_info()).in_flight >= 1
        # The Watch is open before the signal: the leaving replica's health port belongs to its
        # worker 0, which, with none of the streams, finishes its drain within milliseconds and
        # closes the port; a Watch opened after the signal found it closed (refused, UNAVAILABLE).
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        async with grpc.aio.insecure_channel(leaving.health_target) as health_channel:
            watch = health_pb2_grpc.HealthStub(health_channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=60
            )
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            leaving.proc.popen.send_signal(signal.SIGTERM)
            while (await watch.read()).status != not_serving:
                pass  # each read is the next status change
            watch.cancel()

        # The leaving replica still has streams in flight (it drains for DRAIN_GRACE_S); calls
        # made meanwhile must all be served by the replica that stays.
        outcomes: list[str] = []
        for i in range(20):
            try:
                sample = await client.generate(
                    make_sample(PROMPT), params(4), request_id=f"during-drain-{i}", timeout=60
                )
                outcomes.append(pb.SampleStatus.Name(sample.status))
            except grpc.aio.AioRpcError as exc:
                outcomes.append(exc.code().name)
        # The leaving replica ends its streams ABORTED at the grace and exits; then the streams
        # on the staying replica are aborted too: every stream ends with its sample.
        assert await asyncio.to_thread(leaving.proc.popen.wait, DRAIN_GRACE_S + 20) == 0
        await client.abort(all=True)
        for stream in streams:
            assert_aborted(stream, await stream.final())
        assert outcomes == ["SAMPLE_STATUS_TRUNCATED"] * 20, outcomes
        assert all(fleet.replica_serving(f"during-drain-{i}") == [1] for i in range(20))
        assert staying.proc.popen.poll() is None
