"""A trainer's burst reaches admission: no call is CANCELLED unseen (issue 24 item 8).

gRPC core keeps calls that arrived before the application asked for them in a pending queue
guarded by a random-early-detection backlog protector (`grpc.server.max_pending_requests`, soft
1000, and `grpc.server.max_pending_requests_hard_limit`, 3000, by default): above the soft limit a
growing random share of new calls is refused before the replica sees them. grpc.aio asks for one
call per event-loop turn, so a burst of a few thousand calls at once fills that queue; the refused
calls end CANCELLED (before the fix: 2048 Generate -> 199-225, 4096 GetServerInfo -> 1475-1486),
with no `generate_done` line, no admission decision and no retry hint. The replica sizes the
protector from its admission limit plus queue, so every call is served, queued, or refused by
admission with RESOURCE_EXHAUSTED and its retry hint.

The callers run in a process of their own (as a trainer does), the engine in another; each call
generates 2 tokens, so the burst costs little CPU on a loaded 2-core machine, and the bound on
the whole burst is generous (it only catches a hang).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.faults.support import processes, sim_process
from tests.harness import running_server
from tests.support.processes import REPO, child_env

#: Bound on one burst (a few seconds when unloaded); far above it, a hang.
BURST_BOUND_S = 240.0


async def _burst(target: str, method: str, calls: int) -> dict[str, Any]:
    """Run `tests.support.burst` in its own process and return its counts."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.burst",
        target,
        method,
        str(calls),
        "--timeout",
        str(BURST_BOUND_S - 30),
        cwd=REPO,
        env=child_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), BURST_BOUND_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(("method", "calls"), [("generate", 2048), ("info", 4096)])
async def test_a_burst_of_calls_is_never_cancelled_unseen(tmp_path: Path, method: str, calls: int) -> None:
    with processes(tmp_path) as procs:
        engine = sim_process(procs, "engine", token_delay_ms=1)
        # Admission runs 512 and queues 4096 (the defaults): every Generate of the burst fits.
        async with running_server([engine.url], health_interval_s=600.0) as server:
            result = await _burst(f"127.0.0.1:{server.port}", method, calls)
    codes = result["codes"]
    print(f"{method} x{calls}: {codes} in {result['elapsed_s']} s")
    assert codes.get("CANCELLED", 0) == 0, codes
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert result["retry_hint_missing"] == 0, result
    assert codes.get("OK", 0) == calls, codes  # the burst fits admission: every call served
