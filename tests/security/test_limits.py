"""Request bounds, the per-caller in-flight share and the per-caller control rate limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.server.domain.errors import ResourceExhausted
from rollout_grpc.server.security.limits import ControlRateLimiter
from tests.harness import harness, running_server, sim_engines
from tests.security.credentials import TRAINER_A, TRAINER_B
from tests.support.service import PROMPT, SLOW_SIM, field_violation, start_stream, started

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


async def _refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


async def test_request_size_caps_name_the_field_and_the_limit() -> None:
    async with harness(
        "sim", max_abort_ids=10, max_metadata_bytes=1000, max_stop_strings=2, max_stop_string_chars=8
    ) as h:
        err = await _refused(h.client.abort(request_ids=[f"id-{i}" for i in range(11)]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(err) == "request_ids.ids" and "max_abort_ids=10" in (err.details() or "")
        assert (await h.client.abort(request_ids=[f"id-{i}" for i in range(10)])).aborted == 0

        sample = make_sample(PROMPT)
        sample.metadata.update({"blob": "x" * 2000})
        err = await _refused(h.client.generate(sample, GREEDY))
        assert field_violation(err) == "sample.metadata" and "max_metadata_bytes=1000" in (
            err.details() or ""
        )

        err = await _refused(h.client.generate(make_sample(PROMPT), {**GREEDY, "stop": ["a", "b", "c"]}))
        assert field_violation(err) == "sampling_params.stop" and "max_stop_strings=2" in (
            err.details() or ""
        )
        err = await _refused(h.client.generate(make_sample(PROMPT), {**GREEDY, "stop": ["ok", "x" * 9]}))
        assert field_violation(err) == "sampling_params.stop[1]"

        kwargs = struct_pb2.Struct()
        kwargs.update({"k": "v" * (70 << 10)})
        render = h.client.stub.Render(pb.RenderRequest(text="hi", chat_template_kwargs=kwargs))
        err = await _refused(render)
        assert field_violation(err) == "chat_template_kwargs"
        assert "max_chat_template_kwargs_bytes" in (err.details() or "")

        # A Struct may hold infinities, JSON may not: the caller's error, not INTERNAL (found by
        # tests/security/test_fuzz.py).
        kwargs = struct_pb2.Struct()
        kwargs.update({"": float("inf")})
        err = await _refused(h.client.stub.Render(pb.RenderRequest(text="hi", chat_template_kwargs=kwargs)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violation(err) == "chat_template_kwargs" and "finite" in (err.details() or "")


async def test_one_caller_cannot_take_every_slot(tokens_file: Path) -> None:
    async with (
        sim_engines(1, **SLOW_SIM) as sims,
        running_server(
            [s.url for s in sims], auth_tokens_file=str(tokens_file), max_in_flight_per_caller=2
        ) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_A, retry=None) as a,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_B, retry=None) as b,
    ):
        streams = [start_stream(a, f"a-{i}") for i in range(2)]
        await started(*streams)
        err = await _refused(a.generate(make_sample(PROMPT), GREEDY))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_in_flight_per_caller=2" in (err.details() or "")
        # Another caller still gets its share.
        assert (await b.generate(make_sample(PROMPT), GREEDY)).response_length == 2
        assert (await a.abort(request_ids=["a-0", "a-1"])).aborted == 2
        for stream in streams:
            await stream.task
        # The share is free again once the generations ended.
        assert (await a.generate(make_sample(PROMPT), GREEDY)).response_length == 2
        assert server.registry.owned_by("trainer-a") == 0


async def test_control_rpcs_are_rate_limited_per_caller(tokens_file: Path) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims], auth_tokens_file=str(tokens_file), control_rate_per_s=0.01, control_burst=3
        ) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_A, retry=None) as a,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_B, retry=None) as b,
    ):
        for _ in range(3):
            await a.abort(request_ids=["x"])
        err = await _refused(a.abort(request_ids=["x"]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "control_rate_per_s" in (err.details() or "")
        assert dict(err.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
        await b.abort(request_ids=["x"])  # B has its own bucket
        # Generate is not a control RPC.
        assert (await a.generate(make_sample(PROMPT), GREEDY)).response_length == 2


def test_rate_limiter_refills_over_time() -> None:
    now = [0.0]
    limiter = ControlRateLimiter(rate_per_s=2.0, burst=1, clock=lambda: now[0])
    limiter.acquire("a")
    with pytest.raises(ResourceExhausted):
        limiter.acquire("a")
    now[0] = 0.5
    limiter.acquire("a")
    assert not ControlRateLimiter(0.0, 1).enabled


async def test_long_unknown_id_list_is_refused_before_engine_work() -> None:
    """The 2M-id abort of the issue (here 200k): refused at once, no engine call made."""
    async with harness("sim") as h:
        core = h.sims[0].core
        before = core.stats.abort_calls
        err = await _refused(h.client.abort(request_ids=[f"{i:07d}" for i in range(200_000)], timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert core.stats.abort_calls == before
        assert (await h.client.generate(make_sample(PROMPT), GREEDY)).response_length == 2
