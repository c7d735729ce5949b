"""The per-peer budget of failed authentications and the bound on refusal audit lines (fake clock)."""

from __future__ import annotations

import pytest

from rollout_grpc.server.domain.errors import ResourceExhausted
from rollout_grpc.server.security.refusals import AuthFailureLimiter, RefusalSampler, peer_host


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_peer_host_drops_the_port_only() -> None:
    assert peer_host("ipv4:10.0.0.1:5000") == "ipv4:10.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_failures_past_the_burst_are_resource_exhausted_per_peer_until_refilled() -> None:
    clock = Clock()
    limiter = AuthFailureLimiter(rate_per_s=1.0, burst=3, clock=clock)
    for _ in range(3):
        limiter.failed("ipv4:10.0.0.1:1")
    with pytest.raises(ResourceExhausted, match="auth_failure_burst=3") as err:
        limiter.failed("ipv4:10.0.0.1:2")  # another port of the same host shares the budget
    assert 0 < err.value.retry_after_s <= 1.0
    limiter.failed("ipv4:10.0.0.2:1")  # another host has its own
    clock.now += 1.0
    limiter.failed("ipv4:10.0.0.1:3")  # one refilled
    with pytest.raises(ResourceExhausted):
        limiter.failed("ipv4:10.0.0.1:3")


def test_the_peer_table_is_bounded() -> None:
    clock = Clock()
    limiter = AuthFailureLimiter(rate_per_s=0.0, burst=1, max_peers=2, clock=clock)
    limiter.failed("ipv4:a:1")
    limiter.failed("ipv4:b:1")
    limiter.failed("ipv4:c:1")  # drops a, the oldest
    limiter.failed("ipv4:a:1")  # a starts afresh
    with pytest.raises(ResourceExhausted):
        limiter.failed("ipv4:c:1")


def test_a_zero_burst_disables_the_failure_limit() -> None:
    limiter = AuthFailureLimiter(rate_per_s=0.0, burst=0)
    for _ in range(100):
        limiter.failed("ipv4:10.0.0.1:1")


def test_refusal_lines_past_the_bound_are_counted_and_reported_with_the_next_line() -> None:
    clock = Clock()
    sampler = RefusalSampler(rate_per_s=1.0, burst=2, clock=clock)
    assert [sampler.admit() for _ in range(5)] == [0, 0, None, None, None]
    clock.now += 1.0
    assert sampler.admit() == 3  # the three left out, said with this line
    assert sampler.admit() is None
    assert RefusalSampler(rate_per_s=0.0, burst=0).admit() == 0  # sampling off: every line
