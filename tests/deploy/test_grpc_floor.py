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

import pytest

from bench import grpc_floor

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
    assert re.search(r"median [\d,]+ us of server CPU per call of 3 messages = [\d.]+ s/Mtok", out), out


class _OneShort:
    """A request codec whose server side streams one message fewer than the client asked for."""

    def pack(self, messages: int, interval_us: int, tokens: int) -> bytes:
        return struct.pack("<III", messages - 1, interval_us, tokens)

    def unpack(self, data: bytes) -> tuple[int, ...]:
        return struct.unpack("<III", data)


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
