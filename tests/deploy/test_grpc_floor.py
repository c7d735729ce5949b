"""bench/grpc_floor.py measures a bare grpc.aio server; it must really stream what it is asked for.

The floor it reports (server CPU per call and per message) is only the floor of the service's call
shape if every call got exactly its messages: a short count is an error, not a cheaper call.
"""

from __future__ import annotations

import asyncio
import re
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bench import grpc_floor
from rollout_grpc._proto import rollout_pb2 as pb

REPO = Path(__file__).resolve().parents[2]


def test_a_short_run_reports_cpu_per_call_and_per_message() -> None:
    args = ["--concurrency", "4", "--requests", "12", "--messages", "3", "--interval-ms", "5", "--reps", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "bench.grpc_floor", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert re.search(
        r"rep 0: 12 calls x 3 messages in [\d.]+ s; server CPU [\d.]+ s = [\d,]+ us/call", out
    ), out
    assert re.search(r"first message p50 [\d.]+ ms, p99 [\d.]+ ms", out), out
    assert re.search(r"median [\d,]+ us of server CPU per call of 3 messages = [\d.]+ s/Mtok", out), out


class _OneShort:
    """A request codec whose server side streams one message fewer than the client asked for."""

    def pack(self, messages: int, interval_us: int, tokens: int, quantum_us: int) -> bytes:
        return struct.pack("<IIII", messages - 1, interval_us, tokens, quantum_us)

    def unpack(self, data: bytes) -> tuple[int, ...]:
        return struct.unpack("<IIII", data)


def test_a_call_with_fewer_messages_than_asked_for_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_floor, "_REQUEST", _OneShort())

    async def scenario() -> None:
        server, port = await grpc_floor.start_server()
        try:
            with pytest.raises(RuntimeError, match="2 messages, asked for 3"):
                await grpc_floor.run_calls(f"127.0.0.1:{port}", 2, 4, 3, 0, 4, 1)
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_aligned_writes_still_send_every_message() -> None:
    async def scenario() -> None:
        server, port = await grpc_floor.start_server()
        try:
            run = await grpc_floor.run_calls(f"127.0.0.1:{port}", 3, 6, 4, 10, 2, 1, align_ms=5)
        finally:
            await server.stop(None)
        assert len(run.first_message_s) == 6
        assert run.first_message_s == sorted(run.first_message_s)

    asyncio.run(scenario())


def test_held_streams_end_with_an_aborted_sample_only_when_released() -> None:
    async def scenario() -> None:
        server, port = await grpc_floor.start_server()
        target = f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                release: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    grpc_floor.RELEASE_METHOD
                )
                held: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
                    grpc_floor.HELD_METHOD
                )
                call = held(b"")
                first = await call.read()
                assert isinstance(first, bytes)
                assert pb.GenerateResponse.FromString(first).HasField("delta")
                # The release finds the stream held, and only then does it end.
                assert struct.unpack("<I", await release(b""))[0] == 1
                last = await call.read()
                assert isinstance(last, bytes)
                final = pb.GenerateResponse.FromString(last)
                assert final.sample.status == pb.SAMPLE_STATUS_ABORTED
                assert await call.read() is grpc.aio.EOF
                assert struct.unpack("<I", await release(b""))[0] == 0  # nothing left held
            result = await grpc_floor.abort_floor(target, 16, connections=2)
        finally:
            await server.stop(None)
        assert (result.in_flight, result.aborted, result.other) == (16, 16, 0)
        assert 0 <= result.p50_delivery_s <= result.last_delivery_s

    asyncio.run(scenario())
