"""A fleet of engines: failover without loss, affinity, admission limits, health that follows engines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc.client import AsyncRolloutClient, ResourceExhaustedError, make_sample, pb
from rollout_grpc.server.app import SERVICE_NAME
from tests.harness import harness, running_server, sim_engines
from tests.support.fleet import session_on
from tests.support.service import PROMPT, assert_lossless, start_stream, started


async def test_engine_dropped_mid_stream_fails_over_without_loss() -> None:
    async with harness("sim", sim_count=2, sim_config={"token_delay_s": 0.001}) as h:
        bad, good = h.sims
        bad.faults.drop_connection = 1
        bad.faults.drop_after_tokens = 40
        sid = session_on(h.sims, bad, h.server.pool.pick)
        sample = make_sample(PROMPT, session_id=sid)
        stream = start_stream(
            h.client,
            "failover",
            {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True},
            sample=sample,
        )
        final = await stream.task
        assert final.status == pb.SAMPLE_STATUS_TRUNCATED
        assert final.response_length == 200
        assert_lossless(stream, final)
        engines = [a.engine for a in final.engine_attempts]
        assert engines == [bad.url, good.url]
        assert final.engine_attempts[0].end == 40 and final.engine_attempts[0].error
        assert final.engine_attempts[1].start == 40 and final.engine_attempts[1].end == 200
        assert sum(w.end - w.start for w in final.weight_versions) == 200


async def test_all_engines_lost_ends_aborted_with_partial_tokens() -> None:
    async with harness("sim", sim_count=2, sim_config={"token_delay_s": 0.001}) as h:
        for sim in h.sims:
            sim.faults.drop_connection = -1
            sim.faults.drop_after_tokens = 10
        stream = start_stream(
            h.client, "doomed", {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}
        )
        final = await stream.task
        assert final.status == pb.SAMPLE_STATUS_ABORTED
        assert final.response_length == 20
        assert "engine" in final.failure_reason
        assert_lossless(stream, final)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 5})
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_same_session_same_engine_from_two_replicas() -> None:
    async with sim_engines(3) as sims:
        urls = [s.url for s in sims]
        async with contextlib.AsyncExitStack() as stack:
            clients = []
            for order in (urls, list(reversed(urls))):
                server = await stack.enter_async_context(running_server(order))
                clients.append(
                    await stack.enter_async_context(AsyncRolloutClient(f"127.0.0.1:{server.port}"))
                )
            chosen: dict[str, set[str]] = {}
            for i in range(12):
                sid = f"s-{i}"
                for client in clients:
                    sample = await client.generate(make_sample(PROMPT, session_id=sid), {"max_new_tokens": 2})
                    chosen.setdefault(sid, set()).add(sample.engine_attempts[0].engine)
            assert all(len(engines) == 1 for engines in chosen.values())
            assert len({next(iter(e)) for e in chosen.values()}) > 1, "sessions should spread over engines"


async def test_admission_limit_and_queue_overflow() -> None:
    async with harness(
        "sim", sim_config={"token_delay_s": 0.01}, server_concurrency=2, max_queue=2, retry_after_s=0.5
    ) as h:
        streams = [
            start_stream(h.client, f"q-{i}", {"max_new_tokens": 5000, "ignore_eos": True}) for i in range(4)
        ]
        firsts = [asyncio.ensure_future(s.first.wait()) for s in streams]
        await asyncio.wait(firsts, return_when=asyncio.FIRST_COMPLETED)
        info = await h.client.server_info()
        while info.in_flight < 2 or info.queued < 2:  # all four callers reached the replica
            info = await h.client.server_info()
        for waiter in firsts:
            waiter.cancel()
        assert info.in_flight == 2 and info.queued == 2
        with pytest.raises(ResourceExhaustedError) as err:
            await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 2})
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(err.value.trailing_metadata() or ())
        assert trailers.get("grpc-retry-pushback-ms") == "500"
        assert err.value.retry_after == 0.5
        # The same hint from the server's google.rpc.RetryInfo alone (without the pushback trailer).
        rich = [(k, v) for k, v in err.value.trailing_metadata() or () if k != "grpc-retry-pushback-ms"]
        assert ResourceExhaustedError(err.value.code(), None, grpc.aio.Metadata(*rich)).retry_after == 0.5
        assert h.sims[0].core.load <= 2
        await h.client.abort(all=True)
        samples = await asyncio.gather(*(s.task for s in streams))
        assert all(s.status == pb.SAMPLE_STATUS_ABORTED for s in samples)
        for stream, sample in zip(streams, samples, strict=True):
            assert_lossless(stream, sample)


@contextlib.asynccontextmanager
async def watch(port: int) -> AsyncIterator[AsyncIterator[health_pb2.HealthCheckResponse]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        try:
            yield call.__aiter__()
        finally:
            call.cancel()


async def test_health_follows_engine_availability() -> None:
    async with harness("sim", sim_count=2) as h:
        assert h.server.health_port is not None
        async with watch(h.server.health_port) as updates:
            serving = health_pb2.HealthCheckResponse.SERVING
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await anext(updates)).status == serving
            for sim in h.sims:
                sim.set_dead(True)
            while (await anext(updates)).status != not_serving:
                pass
            h.sims[1].set_dead(False)
            while (await anext(updates)).status != serving:
                pass
            sample = await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 3})
            assert sample.engine_attempts[0].engine == h.sims[1].url
        # The same answers on the main port (health is served on both).
        async with grpc.aio.insecure_channel(h.target) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_client_cancel_closes_the_engine_request() -> None:
    async with harness("sim", sim_config={"token_delay_s": 0.005}) as h:
        stream = start_stream(h.client, "cancel-me", {"max_new_tokens": 5000, "ignore_eos": True})
        await started(stream)
        assert h.sims[0].core.load == 1
        stream.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stream.task
        await asyncio.wait_for(h.sims[0].wait_idle(), 10)
        assert h.sims[0].core.load == 0


async def test_a_callers_deadline_closes_the_engine_request() -> None:
    """The replica ends the call with its sample just before the deadline (ABORTED, tokens kept;
    DEADLINE_EXCEEDED only if a loaded machine misses the margin) and ends the engine's request:
    aborted upstream before the deadline (rollout/deadline.py), or closed if that came too late."""
    async with harness("sim", sim_config={"token_delay_s": 0.005}) as h:
        try:
            sample = await h.client.generate(
                make_sample(PROMPT), {"max_new_tokens": 5000, "ignore_eos": True}, timeout=0.5
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
        else:
            assert sample.status == pb.SAMPLE_STATUS_ABORTED and 0 < sample.response_length < 5000
        await asyncio.wait_for(h.sims[0].wait_idle(), 10)
        stats = h.sims[0].stats
        assert stats.aborted + stats.disconnects >= 1 and stats.generate_finished == stats.generate_started


async def test_drained_engine_finishes_in_flight_work_and_gets_no_new_work() -> None:
    async with harness("sim", sim_count=2, sim_config={"token_delay_s": 0.002}) as h:
        keep, drop = h.sims
        sid = session_on(h.sims, drop, h.server.pool.pick)
        stream = start_stream(
            h.client,
            "on-drained",
            {"max_new_tokens": 300, "ignore_eos": True},
            sample=make_sample(PROMPT, session_id=sid),
        )
        await started(stream)
        h.server.pool.replace([keep.url])  # as a SIGHUP re-read of an engines file without `drop`
        info = await h.client.server_info()
        assert [e.draining for e in info.engines] == [False, True]
        after = await h.client.generate(make_sample(PROMPT, session_id=sid), {"max_new_tokens": 3})
        assert after.engine_attempts[0].engine == keep.url
        final = await stream.task
        assert final.status == pb.SAMPLE_STATUS_TRUNCATED and final.response_length == 300
        assert [a.engine for a in final.engine_attempts] == [drop.url]
        await h.server.pool.probe_all()
        assert [e.url for e in h.server.pool.engines] == [keep.url]


async def test_server_info_reports_engines() -> None:
    async with harness("sim", sim_count=2) as h:
        info = await h.client.server_info()
        assert [e.url for e in info.engines] == [s.url for s in h.sims]
        assert all(e.healthy and not e.paused and e.weight_version == "default" for e in info.engines)
        assert all(e.model == "sim-llama" for e in info.engines)
        assert info.weight_version == "default" and not info.paused and info.version
