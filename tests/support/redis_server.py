"""A real redis-server on a free loopback port, as a subprocess (like nginx in processes.py).

No config file: every setting is a command-line argument, persistence is off (a test's store
starts empty), and the server runs in the test's work directory.
"""

from __future__ import annotations

import functools
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import (
    LOOPBACK,
    Proc,
    Processes,
    StartupError,
    free_listen_port,
    tcp_accepts,
    wait_until,
)


def redis_binary() -> str | None:
    """redis-server, also when /usr/bin is not on PATH."""
    found = shutil.which("redis-server")
    if found:
        return found
    for candidate in ("/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if Path(candidate).exists():
            return candidate
    return None


@dataclass
class RedisServer:
    """A started redis-server."""

    proc: Proc
    port: int
    password: str = ""

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"


def start_redis(
    procs: Processes,
    binary: str,
    rng: random.Random,
    *,
    name: str = "redis",
    password: str = "",
    port: int = 0,
    attempts: int = 5,
) -> RedisServer:
    """redis-server on `port` (0: a free one below the ephemeral range), retried on a taken port."""
    last = ""
    for attempt in range(attempts):
        chosen = port or free_listen_port(rng)
        workdir = procs.workdir / name
        workdir.mkdir(exist_ok=True)
        argv = [
            binary,
            "--bind", LOOPBACK,
            "--port", str(chosen),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(workdir),
        ]  # fmt: skip
        if password:
            argv += ["--requirepass", password]
        proc = procs.start(f"{name}-{attempt}", argv)
        try:
            wait_until(f"redis-server on port {chosen}", functools.partial(tcp_accepts, chosen), proc)
        except StartupError as exc:
            last = str(exc)
            if "Address already in use" in proc.log_text() and not port:
                continue
            raise
        return RedisServer(proc, chosen, password)
    raise StartupError(f"redis-server did not start after {attempts} attempts; last: {last}")
