"""`--engines-file` re-read on SIGHUP: how deploy/k8s changes a running replica's engine list.

The Kubernetes example mounts the engine list from a ConfigMap and tells operators to send SIGHUP
after editing it. This runs that procedure on a replica process: the file is replaced the way the
kubelet replaces ConfigMap files (a new file renamed over the old), then SIGHUP; the replica must
switch to the new list without a restart and generate on it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.deploy.streams import PROMPT, params
from tests.support.processes import Engine, Processes, Replica, start_engine, start_replica, wait_until

#: Bound on waiting for the replica to apply a new list (a SIGHUP plus one health probe).
APPLY_TIMEOUT_S = 30.0


def write_engines_file(path: Path, urls: list[str]) -> None:
    """Replace the file atomically, with a comment and a blank line as a ConfigMap may hold."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# engines\n\n" + "".join(f"{url}  # engine\n" for url in urls))
    os.replace(tmp, path)


@pytest.fixture
def reloadable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Engine], Replica, Path]]:
    """Two engines; a replica whose engines file lists only the first. One process (`--workers 1`):
    these tests read its log lines one by one (tests/ops/test_workers.py reloads two workers)."""
    procs = Processes(tmp_path_factory.mktemp("engines-file"))
    try:
        engines = [start_engine(procs, f"engine-{i}", token_delay_ms=0, seed=i) for i in range(2)]
        path = procs.workdir / "engines.txt"
        write_engines_file(path, [engines[0].url])
        replica = start_replica(
            procs, "replica", [], ["--workers", "1", "--engines-file", str(path), "--health-interval", "0.2"]
        )
        yield engines, replica, path
    finally:
        procs.stop_all()


async def usable_engines(client: AsyncRolloutClient) -> list[str]:
    """Engines the replica would send new generations to."""
    info = await client.server_info()
    return [e.url for e in info.engines if e.usable]


async def wait_for_engines(client: AsyncRolloutClient, expected: list[str]) -> None:
    """Poll GetServerInfo until the usable engines are `expected` (bounded)."""
    deadline = time.monotonic() + APPLY_TIMEOUT_S
    while sorted(current := await usable_engines(client)) != sorted(expected):
        assert time.monotonic() < deadline, f"engines {current}, expected {expected}"
        await asyncio.sleep(0.05)


async def test_sighup_switches_to_the_rewritten_engines_file(
    reloadable: tuple[list[Engine], Replica, Path],
) -> None:
    engines, replica, path = reloadable
    first, second = (e.url for e in engines)
    assert replica.engines == [first]
    async with AsyncRolloutClient(replica.target) as client:
        assert await usable_engines(client) == [first]

        write_engines_file(path, [second])
        replica.proc.popen.send_signal(signal.SIGHUP)
        await wait_for_engines(client, [second])
        sample = await client.generate(make_sample(PROMPT), params(4), timeout=60)
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED
        assert [a.engine for a in sample.engine_attempts] == [second]

        write_engines_file(path, [first, second])
        replica.proc.popen.send_signal(signal.SIGHUP)
        await wait_for_engines(client, [first, second])
    assert replica.proc.popen.poll() is None  # SIGHUP reloads; it does not stop the replica


async def test_sighup_with_more_engines_raises_the_admission_limit(
    reloadable: tuple[list[Engine], Replica, Path],
) -> None:
    engines, replica, path = reloadable
    urls = [e.url for e in engines]
    async with AsyncRolloutClient(replica.target) as client:
        write_engines_file(path, urls)
        replica.proc.popen.send_signal(signal.SIGHUP)
        await wait_for_engines(client, urls)
    serving = replica.log_events("serving")
    reloaded = replica.log_events("engines_reloaded")
    assert reloaded[-1]["in_flight_limit"] == 2 * int(str(serving[0]["in_flight_limit"]))


async def test_sighup_with_a_bad_line_names_it_and_keeps_the_current_engines(
    reloadable: tuple[list[Engine], Replica, Path],
) -> None:
    """A typo in the edited file must not empty the fleet: the line is named and nothing changes."""
    engines, replica, path = reloadable
    first, second = (e.url for e in engines)
    bad = second.removeprefix("http://")  # line 4: after the comment, the blank line and `first`
    write_engines_file(path, [first, bad])
    replica.proc.popen.send_signal(signal.SIGHUP)
    await asyncio.to_thread(
        wait_until,
        "the invalid-file log line",
        lambda: bool(replica.log_events("engines_file_invalid")),
        replica.proc,
    )
    [record] = replica.log_events("engines_file_invalid")
    assert f"line 4: {bad!r}: no scheme" in str(record["error"])
    assert record["action"] == "kept the current engines"
    async with AsyncRolloutClient(replica.target) as client:
        assert await usable_engines(client) == [first]
    assert not replica.log_events("engines_reloaded")
