"""Abort without loss, continuation, pause/resume for weight sync, weight versions, two replicas."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.harness import Harness, harness, running_server
from tests.support.service import (
    LONG,
    PROMPT,
    SLOW_SIM,
    assert_lossless,
    field_violation,
    start_stream,
    started,
)


@contextlib.asynccontextmanager
async def slow_harness(backend: str, engine_url: str | None) -> AsyncIterator[Harness]:
    async with harness(backend, engine_url, sim_config=SLOW_SIM) as running:
        yield running


async def test_abort_all_returns_every_partial_sample(backend: str, engine_url: str | None) -> None:
    async with slow_harness(backend, engine_url) as h:
        streams = [start_stream(h.client, f"all-{i}") for i in range(32)]
        await started(*streams)
        response = await h.client.abort(all=True)
        assert response.aborted == 32
        assert not response.engine_errors
        samples = await asyncio.gather(*(s.task for s in streams))
        for stream, sample in zip(streams, samples, strict=True):
            assert sample.status == pb.SAMPLE_STATUS_ABORTED
            assert sample.finish_reason == pb.FINISH_REASON_ABORT
            assert sample.response_length >= 1
            assert_lossless(stream, sample)
        info = await h.client.server_info()
        assert not info.paused and not any(e.paused for e in info.engines)
        after = await h.client.generate(
            make_sample(PROMPT), {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        )
        assert after.status == pb.SAMPLE_STATUS_TRUNCATED and after.response_length == 4


async def test_abort_by_id_aborts_only_that_generation(backend: str, engine_url: str | None) -> None:
    async with slow_harness(backend, engine_url) as h:
        victim = start_stream(h.client, "victim")
        other = start_stream(h.client, "other", {**LONG, "max_new_tokens": 400})
        await started(victim, other)
        response = await h.client.abort(request_ids=["victim", "nobody"])
        assert response.aborted == 1
        assert list(response.unknown_request_ids) == ["nobody"]
        aborted = await victim.task
        assert aborted.status == pb.SAMPLE_STATUS_ABORTED
        assert_lossless(victim, aborted)
        finished = await other.task
        assert finished.status == pb.SAMPLE_STATUS_TRUNCATED and finished.response_length == 400
        assert_lossless(other, finished)


async def test_aborted_sample_continues_to_exactly_max_new_tokens(
    backend: str, engine_url: str | None
) -> None:
    async with slow_harness(backend, engine_url) as h:
        params: dict[str, object] = {**LONG, "max_new_tokens": 600}
        stream = start_stream(h.client, "cont", params)
        await started(stream)
        await h.client.abort(request_ids=["cont"])
        aborted = await stream.task
        assert aborted.status == pb.SAMPLE_STATUS_ABORTED
        k = aborted.response_length
        assert 1 <= k < 600
        done = await h.client.generate(aborted, params, {"mask_offpolicy": True})
        assert done.status == pb.SAMPLE_STATUS_TRUNCATED
        assert done.response_length == 600
        assert list(done.tokens[: len(aborted.tokens)]) == list(aborted.tokens)
        assert list(done.rollout_log_probs[:k]) == list(aborted.rollout_log_probs)
        assert list(done.loss_mask) == [0] * k + [1] * (600 - k)
        assert done.response.startswith(aborted.response)


async def test_pause_keep_then_resume_loses_nothing_and_splits_versions(
    backend: str, engine_url: str | None
) -> None:
    async with slow_harness(backend, engine_url) as h:
        params: dict[str, object] = {**LONG, "max_new_tokens": 500}
        streams = [start_stream(h.client, f"keep-{i}", params) for i in range(4)]
        await started(*streams)
        paused = await h.client.pause("keep")
        assert len(paused.paused_engines) == 1 and not paused.engine_errors
        assert (await h.client.server_info()).paused
        resumed = await h.client.resume(weight_version="step-1")
        assert len(resumed.resumed_engines) == 1 and not resumed.engine_errors
        for stream in streams:
            sample = await stream.task
            assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 500
            assert_lossless(stream, sample)
            versions = [(w.version, w.start, w.end) for w in sample.weight_versions]
            assert len(versions) == 2, versions
            (v0, s0, e0), (v1, s1, e1) = versions
            assert v1 == "step-1" and v0 != "step-1"
            assert s0 == 0 and e0 == s1 and e1 == 500
        info = await h.client.server_info()
        assert info.weight_version == "step-1" and not info.paused


async def test_generate_during_abort_all_window_is_aborted_without_engine_call() -> None:
    async with harness("sim", sim_config=SLOW_SIM) as h:
        h.server.rollout.begin_abort_all()
        try:
            before = h.sims[0].stats.generate_requests
            sample = await h.client.generate(make_sample(PROMPT), LONG)
            assert sample.status == pb.SAMPLE_STATUS_ABORTED and sample.response_length == 0
            assert h.sims[0].stats.generate_requests == before
        finally:
            h.server.rollout.end_abort_all()


async def test_abort_sent_to_one_replica_ends_streams_of_another(
    backend: str, engine_url: str | None
) -> None:
    async with slow_harness(backend, engine_url) as a:
        urls = [s.url for s in a.sims] or [str(engine_url)]
        kinds = {"engine_kinds": dict(a.server.config.engine_kinds)}  # the same engines, the same kinds
        async with (
            running_server(urls, peers=[a.target], **kinds) as b_server,
            AsyncRolloutClient(f"127.0.0.1:{b_server.port}") as b,
        ):
            streams = [start_stream(b, f"b-{i}") for i in range(4)]
            await started(*streams)
            response = await a.client.abort(all=True)
            assert response.aborted == 0  # none of them ran on replica A
            for stream in streams:
                sample = await stream.task
                assert sample.status == pb.SAMPLE_STATUS_ABORTED
                assert_lossless(stream, sample)
            # By id, another replica's generation is reached through its peer (engine ids are
            # unique per replica: B cannot name A's engine calls).
            one = start_stream(a.client, "a-by-id")
            await started(one)
            response = await b.abort(request_ids=["a-by-id", "nobody"])
            assert response.aborted == 1
            assert list(response.unknown_request_ids) == ["nobody"]  # the peer knew "a-by-id"
            sample = await one.task
            assert sample.status == pb.SAMPLE_STATUS_ABORTED
            assert_lossless(one, sample)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({}, "target"), ({"request_ids": [""]}, "request_ids.ids")],
)
async def test_bad_abort_is_invalid_argument(h: Harness, kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.client.abort(**kwargs)  # type: ignore[arg-type]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(info.value) == field


async def test_pause_with_unknown_mode_is_invalid_argument(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.client.stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_UNSPECIFIED))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violation(info.value) == "mode"


async def test_session_and_group_aborts_reach_peer_replicas() -> None:
    async with harness("sim", sim_config=SLOW_SIM) as a:
        urls = [s.url for s in a.sims]
        async with (
            running_server(urls, peers=[a.target]) as b_server,
            AsyncRolloutClient(f"127.0.0.1:{b_server.port}") as b,
        ):
            mine = start_stream(b, "s-1", sample=make_sample(PROMPT, session_id="sess", group_index=7))
            other = start_stream(
                a.client, "s-2", sample=make_sample(PROMPT, session_id="sess", group_index=8)
            )
            bystander = start_stream(
                a.client,
                "s-3",
                {**LONG, "max_new_tokens": 300},
                sample=make_sample(PROMPT, session_id="x", group_index=9),
            )
            await started(mine, other, bystander)
            response = await b.abort(session_id="sess")  # B forwards to its peer A
            assert response.aborted == 2
            for stream in (mine, other):
                sample = await stream.task
                assert sample.status == pb.SAMPLE_STATUS_ABORTED
                assert_lossless(stream, sample)
            group = start_stream(a.client, "g-1", sample=make_sample(PROMPT, group_index=42))
            await started(group)
            assert (await b.abort(group_index=42)).aborted == 1
            assert (await group.task).status == pb.SAMPLE_STATUS_ABORTED
            finished = await bystander.task
            assert finished.status == pb.SAMPLE_STATUS_TRUNCATED and finished.response_length == 300


async def test_dns_peer_reaches_every_resolved_replica() -> None:
    async with harness("sim", sim_config=SLOW_SIM) as a:
        urls = [s.url for s in a.sims]
        # "localhost" resolves to this host: the replica skips itself (same port) and reaches A.
        async with (
            running_server(urls, peers=[f"dns:///localhost:{a.server.port}"]) as b_server,
            AsyncRolloutClient(f"127.0.0.1:{b_server.port}") as b,
        ):
            stream = start_stream(a.client, "dns-1", sample=make_sample(PROMPT, session_id="dns-session"))
            await started(stream)
            assert (await b.abort(session_id="dns-session")).aborted == 1
            assert (await stream.task).status == pb.SAMPLE_STATUS_ABORTED
