"""Replicas that share one real redis-server (`--state-store redis://...`), with simulated engines
and optionally the tested nginx config in front, each in its own process (issue 37 item 5).

Which replica served a step is read from its log (`rollout_step_done` names the step id), so a
test can kill the one that did and be sure the next call lands on the other.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tests.support.processes import (
    POLL_S,
    Engine,
    Nginx,
    Processes,
    Replica,
    nginx_binary,
    start_engine,
    start_nginx,
    start_replica,
)
from tests.support.redis_server import RedisServer, redis_binary, start_redis

#: The engines' per-token delay (ms).
TOKEN_DELAY_MS = 2.0
#: How long a replica may take to write a step's log line after its summary was sent.
LOG_LINE_TIMEOUT_S = 10.0


@dataclass
class StoreFleet:
    """One redis-server, simulated engines, replicas using both, nginx in front (when asked)."""

    procs: Processes
    redis: RedisServer
    engines: list[Engine]
    replicas: list[Replica]
    nginx: Nginx | None

    def step_done(self, replica: Replica, step_id: str) -> dict[str, object] | None:
        """`replica`'s `rollout_step_done` record of `step_id`, if it wrote one."""
        found = [r for r in replica.log_events("rollout_step_done") if r.get("step_id") == step_id]
        return found[-1] if found else None

    def served_by(self, step_id: str) -> tuple[int, dict[str, object]]:
        """The index of the replica that served `step_id`, and its log record of it.

        A replica writes the line when the call ends, which may be just after the caller got the
        summary: wait (bounded) for it to appear.
        """
        deadline = time.monotonic() + LOG_LINE_TIMEOUT_S
        while True:
            found = [(i, rec) for i, r in enumerate(self.replicas) if (rec := self.step_done(r, step_id))]
            if found or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        assert len(found) == 1, f"step {step_id} logged by replicas {[i for i, _ in found]}"
        return found[0]


def store_fleet(
    procs: Processes, *, replicas: int = 2, nginx: bool = False, replica_args: Sequence[str] = ()
) -> StoreFleet:
    """A redis-server, two engines, `replicas` single-process replicas sharing the store."""
    binary = redis_binary()
    assert binary is not None, "redis-server is not installed"
    rng = random.Random()
    redis = start_redis(procs, binary, rng)
    engines = [
        start_engine(procs, f"engine-{i}", "--eos-probability", "0", token_delay_ms=TOKEN_DELAY_MS, seed=i)
        for i in range(2)
    ]
    started = [
        start_replica(
            procs,
            f"replica-{i}",
            engines,
            ["--workers", "1", "--state-store", redis.url, *replica_args],
        )
        for i in range(replicas)
    ]
    front = None
    if nginx:
        binary_nginx = nginx_binary()
        assert binary_nginx is not None, "nginx is not installed"
        front = start_nginx(procs, binary_nginx, [r.port for r in started], rng)
    return StoreFleet(procs, redis, engines, started, front)
