"""Fuzz: random requests of every RPC, built from the proto descriptors, against a live replica.

Whatever a caller sends, the replica answers with a status naming what was wrong (never INTERNAL
or UNKNOWN), keeps running, leaves nothing behind (no in-flight generation on the replica, no
request in the engine), and its health check keeps answering. The replica and its simulated engine
run on an event loop in a background thread; the test drives it through a blocking channel, one
example after another, with a bounded budget (400 examples, under 30 s on a quiet machine).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server.app import RolloutServer, ServerConfig
from rollout_grpc.sim import SimConfig, SimEngine
from tests.security.protofuzz import messages

T = TypeVar("T")

#: Codes a well-behaved replica may answer a random request with. INTERNAL and UNKNOWN are bugs.
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
CALL_TIMEOUT_S = 10.0


@dataclass
class LiveReplica:
    """A replica and its engine on a private event loop in a thread."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    server: RolloutServer
    sim: SimEngine

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run `coro` on the replica's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """Run a plain function on the replica's loop (to read its state safely)."""

        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())


@pytest.fixture(scope="module")
def replica() -> Iterator[LiveReplica]:
    """One replica for every example (starting one per example would dominate the time budget)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-replica", daemon=True)
    thread.start()

    async def start() -> tuple[RolloutServer, SimEngine]:
        sim = await SimEngine(SimConfig(max_model_len=256, seed=7)).start()
        server = RolloutServer(
            ServerConfig(
                engines=[sim.url], port=0, health_port=0, health_interval_s=0.2, control_rate_per_s=0
            )
        )
        await server.start()
        return server, sim

    server, sim = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    live = LiveReplica(loop, thread, server, sim)
    try:
        yield live
    finally:
        live.run(server.stop(grace_s=1.0))
        live.run(sim.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def channel(replica: LiveReplica) -> Iterator[grpc.Channel]:
    """A blocking channel to the replica."""
    with grpc.insecure_channel(f"127.0.0.1:{replica.server.port}") as ch:
        yield ch


IDS = ["fz-1", "fz-2", "fz-3"]


@st.composite
def runnable_generates(draw: st.DrawFn) -> pb.GenerateRequest:
    """A valid sample with random parameters and options: requests that reach the engine."""
    request = pb.GenerateRequest(
        sample=pb.Sample(
            tokens=draw(st.lists(st.integers(0, 2047), min_size=1, max_size=8)),
            status=pb.SAMPLE_STATUS_PENDING,
            session_id=draw(st.sampled_from(["", "s-1", "s-2"])),
            group_index=draw(st.integers(0, 2)),
        ),
        request_id=draw(st.sampled_from(IDS)),
    )
    if draw(st.booleans()):
        request.sampling_params.MergeFromString(
            draw(messages(pb.SamplingParams.DESCRIPTOR)).SerializeToString()
        )
    else:
        params = request.sampling_params
        params.temperature = draw(st.floats(0.0, 2.0))
        params.max_new_tokens = draw(st.integers(1, 300))
        params.ignore_eos = draw(st.booleans())
        params.stop.extend(draw(st.lists(st.text(min_size=1, max_size=4), max_size=2)))
    if draw(st.booleans()):
        request.options.MergeFromString(draw(messages(pb.GenerateOptions.DESCRIPTOR)).SerializeToString())
    else:
        request.options.stream_batch_tokens = draw(st.integers(1, 32))
        request.options.skip_text = draw(st.booleans())
    return request


targeted_aborts = st.one_of(
    st.lists(st.sampled_from(IDS), min_size=1).map(
        lambda ids: pb.AbortRequest(request_ids=pb.RequestIds(ids=ids))
    ),
    st.sampled_from(["s-1", "s-2"]).map(lambda s: pb.AbortRequest(session_id=s)),
    st.integers(0, 2).map(lambda g: pb.AbortRequest(group_index=g)),
    st.just(pb.AbortRequest(all=True)),
)


def _local_reward_only(request: Message) -> Message:
    """A random step without a REMOTE reward: the probe would reach out to a random URL."""
    assert isinstance(request, pb.RolloutStepRequest)
    if request.reward.kind == pb.REWARD_KIND_REMOTE:
        request.reward.kind = pb.REWARD_KIND_EXACT_MATCH
    return request


#: (method name, request strategy): every RPC of the public service, and the internal AbortLocal.
RPCS: list[tuple[str, st.SearchStrategy[Message]]] = [
    ("Generate", messages(pb.GenerateRequest.DESCRIPTOR)),
    ("Generate", runnable_generates()),
    ("Abort", messages(pb.AbortRequest.DESCRIPTOR)),
    ("Abort", targeted_aborts),
    ("Render", messages(pb.RenderRequest.DESCRIPTOR)),
    ("Pause", messages(pb.PauseRequest.DESCRIPTOR)),
    (
        "Pause",
        st.sampled_from([pb.PAUSE_MODE_ABORT, pb.PAUSE_MODE_WAIT, pb.PAUSE_MODE_KEEP]).map(
            lambda mode: pb.PauseRequest(mode=mode)
        ),
    ),
    ("Resume", messages(pb.ResumeRequest.DESCRIPTOR)),
    ("GetServerInfo", messages(pb.GetServerInfoRequest.DESCRIPTOR)),
    ("AbortLocal", messages(pb.AbortLocalRequest.DESCRIPTOR)),
    ("RolloutStep", messages(pb.RolloutStepRequest.DESCRIPTOR).map(_local_reward_only)),
]
calls = st.lists(st.one_of(*(st.tuples(st.just(name), s) for name, s in RPCS)), min_size=1, max_size=4)


def _invoke(channel: grpc.Channel, method: str, request: Message) -> None:
    stub: Any
    if method == "AbortLocal":
        stub = pb_grpc.ReplicaServiceStub(channel)
    else:
        stub = pb_grpc.RolloutServiceStub(channel)
    if method in ("Generate", "RolloutStep"):
        for _ in getattr(stub, method)(request, timeout=CALL_TIMEOUT_S):
            pass
    else:
        getattr(stub, method)(request, timeout=CALL_TIMEOUT_S)


def _assert_clean(replica: LiveReplica, channel: grpc.Channel) -> None:
    """No generation left on the replica or in the engine; the engine is not left paused; health."""
    assert replica.run(replica.server.registry.wait_idle(CALL_TIMEOUT_S)), "in-flight entry leaked"
    core = replica.sim.core
    replica.run(asyncio.wait_for(core.wait_until(lambda: not core.tracked()), CALL_TIMEOUT_S))
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="rollout.v1.RolloutService"), timeout=CALL_TIMEOUT_S
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
@given(calls=calls)
def test_random_requests_never_crash_or_leak(
    replica: LiveReplica, channel: grpc.Channel, calls: list[tuple[str, Message]]
) -> None:
    stub = pb_grpc.RolloutServiceStub(channel)

    def one(method: str, request: Message) -> str | None:
        try:
            _invoke(channel, method, request)
        except grpc.RpcError as err:
            call: Any = err
            if call.code() in FORBIDDEN:
                return f"{method}({request}) -> {call.code()}: {call.details()}"
        finally:
            if method == "Pause":
                # A paused engine holds every later request: the fuzz resumes it, like a trainer.
                stub.Resume(pb.ResumeRequest(), timeout=CALL_TIMEOUT_S)
        return None

    # The calls of one example run at once, so that aborts and pauses meet running generations.
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        failures = [f for f in pool.map(lambda c: one(*c), calls) if f is not None]
    assert not failures, failures
    _assert_clean(replica, channel)
