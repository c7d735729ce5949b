"""Nothing large is decoded before authentication: an unauthenticated caller's request is never
read off the wire, a control RPC's is capped even after authentication, failed authentications
are rate-limited per peer, and refusals do not flood the audit log.

The memory checks run the replica as its own process (`rollout-grpc serve`) and read its peak
resident set (`VmHWM` in /proc/PID/status) before and after: before the fix, one unauthenticated
63 MiB Abort took a replica from ~70 MB to ~900 MB, two at once past 1.5 GB.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rollout_grpc.client import AsyncRolloutClient, make_sample
from rollout_grpc.server.app import RolloutServer
from tests.harness import running_server, sim_engines
from tests.security.credentials import ADMIN, TRAINER_A
from tests.support.processes import Processes, Replica, start_engine, start_replica
from tests.support.service import PROMPT

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20
ABORT = "/rollout.v1.RolloutService/Abort"
GENERATE = "/rollout.v1.RolloutService/Generate"
#: Peak-RSS growth a refused 63 MiB request may cause: the bytes are never read (an unauthenticated
#: caller) or read once as bytes and refused before decoding (an authenticated one).
UNREAD_BOUND = 48 * MIB
READ_ONCE_BOUND = 256 * MIB


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def abort_bytes(size: int) -> bytes:
    """A serialized AbortRequest{request_ids} of about `size` bytes: 8-character ids, millions of
    them (built as bytes: a client-side message of that many ids would itself take gigabytes)."""
    entry = b"\x0a\x08" + b"rid-0000"
    inner = entry * (size // len(entry))
    return b"\x12" + _varint(len(inner)) + inner


def peak_rss(pid: int) -> int:
    """The process's peak resident set size (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


@contextlib.contextmanager
def replica(tmp_path: Path, tokens: Path) -> Iterator[Replica]:
    """A `rollout-grpc serve` process with the tokens file, on one simulated engine process."""
    with Processes(tmp_path / "procs") as procs:
        engine = start_engine(procs, "engine", token_delay_ms=0.0)
        yield start_replica(procs, "replica", [engine], ["--auth-tokens-file", str(tokens)])


async def _raw_call(target: str, method: str, payload: bytes, token: str | None) -> grpc.StatusCode:
    """Send `payload` as the request bytes of `method` and return the status code."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(target) as channel:
        call: Any = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            await call(payload, metadata=metadata, timeout=60)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def _warm_up(target: str) -> None:
    """One authenticated Generate, so the baseline includes everything a served call loads."""
    async with AsyncRolloutClient(target, token=TRAINER_A, retry=None) as trainer:
        sample = await trainer.generate(make_sample(PROMPT), {"max_new_tokens": 2, "ignore_eos": True})
        assert sample.response_length == 2


async def test_unauthenticated_63mib_aborts_are_refused_without_reading_them(
    tmp_path: Path, tokens_file: Path
) -> None:
    payload = abort_bytes(63 * MIB)
    with replica(tmp_path, tokens_file) as server:
        await _warm_up(server.target)
        before = peak_rss(server.proc.pid)
        codes = await asyncio.gather(*(_raw_call(server.target, ABORT, payload, None) for _ in range(4)))
        grown = peak_rss(server.proc.pid) - before
        # Another caller is served normally afterwards.
        await _warm_up(server.target)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    assert grown < UNREAD_BOUND, f"peak RSS grew by {grown / MIB:.0f} MiB for 4 unread requests"


async def test_an_authenticated_control_rpc_is_capped_before_decoding(
    tmp_path: Path, tokens_file: Path
) -> None:
    payload = abort_bytes(63 * MIB)
    with replica(tmp_path, tokens_file) as server:
        await _warm_up(server.target)
        before = peak_rss(server.proc.pid)
        async with grpc.aio.insecure_channel(server.target) as channel:
            call: Any = channel.unary_unary(ABORT, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(payload, metadata=(("authorization", f"Bearer {TRAINER_A}"),), timeout=60)
        grown = peak_rss(server.proc.pid) - before
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_control_request_bytes" in (err.value.details() or "")
    assert grown < READ_ONCE_BOUND, f"peak RSS grew by {grown / MIB:.0f} MiB for one capped request"


# ----------------------------------------------------------------------------- in-process replica


@contextlib.asynccontextmanager
async def authed(tokens: Path, **config: Any) -> AsyncIterator[RolloutServer]:
    async with (
        sim_engines(1) as sims,
        running_server([s.url for s in sims], auth_tokens_file=str(tokens), **config) as server,
    ):
        yield server


def trainer_of(server: RolloutServer) -> AsyncRolloutClient:
    return AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_A, retry=None)


async def test_trainers_still_send_tens_of_mib_to_generate(tokens_file: Path) -> None:
    """R3-sized inputs (a partial sample's routing, long prompts) pass the door once authenticated."""
    async with authed(tokens_file) as server:
        sample = make_sample(PROMPT)
        sample.response = "x" * (24 * MIB)  # a 24 MiB field the replica must read and decode
        async with AsyncRolloutClient(f"127.0.0.1:{server.port}", token=TRAINER_A, retry=None) as trainer:
            done = await trainer.generate(sample, {"max_new_tokens": 2, "ignore_eos": True})
    assert done.response_length == 2 and done.response.startswith("x" * 1024)


async def test_rollout_step_runs_through_the_wire_wrapper(tokens_file: Path) -> None:
    """RolloutStep is request-unary, response-streaming: read after auth, then streamed back."""
    async with authed(tokens_file) as server, trainer_of(server) as trainer:
        events = [
            e
            async for e in trainer.rollout_step(
                [(make_sample(PROMPT), 0)],
                n_samples_per_prompt=2,
                params={"max_new_tokens": 2, "ignore_eos": True},
                timeout=60,
            )
        ]
    [group] = [e.group for e in events if e.WhichOneof("event") == "group"]
    assert [s.response_length for s in group.samples] == [2, 2]


async def test_failed_authentication_is_rate_limited_per_peer(tokens_file: Path) -> None:
    async with authed(tokens_file, auth_failure_rate_per_s=0.01, auth_failure_burst=5) as server:
        target = f"127.0.0.1:{server.port}"
        codes = [await _raw_call(target, ABORT, b"", "not-a-token") for _ in range(8)]
        # A valid credential from the same address still gets in.
        async with AsyncRolloutClient(target, token=ADMIN, retry=None) as admin:
            await admin.abort(request_ids=["nothing"])
    assert codes[:5] == [grpc.StatusCode.UNAUTHENTICATED] * 5
    assert codes[5:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3


async def test_refusals_are_audited_within_a_bound(tokens_file: Path) -> None:
    async with authed(tokens_file, auth_failure_rate_per_s=0, refusal_audit_burst=10) as server:
        target = f"127.0.0.1:{server.port}"
        with structlog.testing.capture_logs() as logs:
            async with grpc.aio.insecure_channel(target) as channel:
                call: Any = channel.unary_unary(
                    "/rollout.v1.RolloutService/Pause", request_serializer=None, response_deserializer=None
                )
                for _ in range(200):
                    with pytest.raises(grpc.aio.AioRpcError):
                        await call(b"", timeout=10)
    audit = [e for e in logs if e["event"] == "audit"]
    assert 10 <= len(audit) <= 12, len(audit)
    assert all(a["outcome"] == "UNAUTHENTICATED" for a in audit)


async def test_a_flood_of_failed_authentications_is_counted_not_logged_line_by_line(
    tokens_file: Path,
) -> None:
    async with authed(tokens_file, auth_failure_rate_per_s=0.01, auth_failure_burst=3) as server:
        target = f"127.0.0.1:{server.port}"
        with structlog.testing.capture_logs() as logs:
            codes = [await _raw_call(target, GENERATE, b"", None) for _ in range(6)]
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    assert [e["code"] for e in logs if e["event"] == "generate_done"] == ["UNAUTHENTICATED"] * 3


async def test_health_requests_are_capped_on_both_ports(tokens_file: Path) -> None:
    """Health is open to everyone, so its requests (one service name) are capped before decoding:
    on the main port by the wrapper, on the health port by its gRPC message limit."""
    async with authed(tokens_file) as server:
        big = health_pb2.HealthCheckRequest(service="s" * (64 << 10)).SerializeToString()
        small = health_pb2.HealthCheckRequest(service="").SerializeToString()
        check = "/grpc.health.v1.Health/Check"
        assert (
            await _raw_call(f"127.0.0.1:{server.port}", check, big, None) == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert await _raw_call(f"127.0.0.1:{server.health_port}", check, big, None) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        for port in (server.port, server.health_port):
            assert await _raw_call(f"127.0.0.1:{port}", check, small, None) == grpc.StatusCode.OK


async def test_reflection_messages_are_capped_before_decoding(tokens_file: Path) -> None:
    """Open reflection (`--reflection-open`) reads what anyone sends: each message is capped."""
    async with (
        authed(tokens_file, reflection_open=True, max_control_request_bytes=4096) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        small = reflection_pb2.ServerReflectionRequest(list_services="")
        [answer] = [r async for r in stub.ServerReflectionInfo(iter([small]), timeout=10)]
        assert answer.HasField("list_services_response")
        big = reflection_pb2.ServerReflectionRequest(file_by_filename="f" * 8192)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [r async for r in stub.ServerReflectionInfo(iter([big]), timeout=10)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_control_request_bytes=4096" in (err.value.details() or "")
