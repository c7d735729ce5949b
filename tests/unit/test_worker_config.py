"""How a worker of `serve --workers N` derives its settings from the replica's (workers/worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_grpc.server.app import ServerConfig, worker_share
from rollout_grpc.server.workers.handshake import WorkerSpec
from rollout_grpc.server.workers.supervisor import cgroup_cpus
from rollout_grpc.server.workers.worker import worker_config


def _spec(index: int, workers: int = 2) -> WorkerSpec:
    return WorkerSpec(
        index=index,
        workers=workers,
        port=1234,
        run_dir="/run",
        secret="s",
        engines=["http://e"],
        openai_port=4321,
    )


@pytest.mark.parametrize(("total", "workers"), [(1024, 2), (7, 3), (1, 4), (0, 2)])
def test_the_shares_of_a_limit_add_up_to_it(total: int, workers: int) -> None:
    shares = [worker_share(total, i, workers) for i in range(workers)]
    assert min(shares) >= 1  # a limit below the worker count is exceeded by that much
    if total >= workers:
        assert sum(shares) == total


def test_a_worker_gets_its_share_of_every_replica_wide_limit() -> None:
    def base() -> ServerConfig:
        return ServerConfig(
            engines=["http://a", "http://b"], server_concurrency=3, max_queue=9, openai_port=0
        )

    first, second = worker_config(base(), _spec(0)), worker_config(base(), _spec(1))
    # The in-flight limit is the replica's, counted by the workers together (workers/admission.py).
    assert (first.in_flight_limit(), second.in_flight_limit()) == (6, 6)
    assert (first.max_queue, second.max_queue) == (5, 4)
    assert first.max_pending_calls == second.max_pending_calls == 0  # still sized from admission
    assert first.pending_calls_limit() == 6 + 5 + 1000
    assert (first.port, first.reuse_port, first.metrics_port) == (1234, True, None)
    # Every worker serves the front door on the port the supervisor reserved; worker 0 alone health.
    assert first.openai_port == second.openai_port == 4321
    assert first.health_port is not None and second.health_port is None


def test_the_default_worker_count_follows_a_cgroup_cpu_quota(tmp_path: Path) -> None:
    path = tmp_path / "cpu.max"
    path.write_text("150000 100000\n")
    assert cgroup_cpus(str(path)) == 2
    path.write_text("max 100000\n")
    assert cgroup_cpus(str(path)) is None
    assert cgroup_cpus(str(tmp_path / "missing")) is None


def test_the_shutdown_bound_of_workers_includes_the_drains_first_phase() -> None:
    """With `--workers N` every worker first stops accepting (one control deadline at most, when a
    worker does not answer), then runs one process's stop: the replica's bound is both."""
    config = ServerConfig(engines=[], grace_s=60.0, control_deadline_s=4.0)
    one = config.shutdown_bound_s()
    assert config.shutdown_bound_s(workers=1) == one
    assert config.shutdown_bound_s(workers=2) == one + 4.0
    assert config.shutdown_bound_s(grace_s=0.0, workers=3) == one - 60.0 + 4.0
