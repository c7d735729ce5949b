"""The target a client is made with: a URL or a bad port is a ValueError when the client is made.

Before, both clients took `http://host:port` and gRPC failed only the first call, after its retries
and deadline, with "UNAVAILABLE: ... Misformatted domain name".
"""

from __future__ import annotations

import re

import pytest

from rollout_grpc.client import AsyncRolloutClient, RolloutClient
from rollout_grpc.client.channel import check_target


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("http://127.0.0.1:50051", "is a URL; a gRPC target is host:port: '127.0.0.1:50051'"),
        (
            "https://rollout.example:443/",
            "is a URL; a gRPC target is host:port: 'rollout.example:443' (and tls=True)",
        ),
        ("grpc://10.0.0.7:50051", "is a URL; a gRPC target is host:port: '10.0.0.7:50051'"),
        ("localhost:50051/", "the port must be a number 0-65535, got '50051/'"),
        ("127.0.0.1:99999", "the port must be a number 0-65535, got '99999'"),
        ("replica:", "the port must be a number 0-65535, got ''"),
        ("", "target must be a gRPC target such as 'host:port', got ''"),
    ],
)
def test_both_clients_refuse_a_target_that_is_not_one(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RolloutClient(target)
    with pytest.raises(ValueError, match=re.escape(message)):
        AsyncRolloutClient(target)


@pytest.mark.parametrize(
    "target",
    [
        "127.0.0.1:50051",
        "rollout-grpc.default.svc:50051",
        "[::1]:50051",
        "::1",
        "2001:db8::5",
        "dns:///rollout-grpc:50051",
        "unix:/run/rollout.sock",
        "ipv4:10.0.0.1:50051,10.0.0.2:50051",
        "localhost",
    ],
)
def test_grpc_targets_pass_as_they_are(target: str) -> None:
    assert check_target(target) == target
    RolloutClient(target).close()


def test_surrounding_whitespace_is_dropped() -> None:
    """A target read from a file or an environment variable often ends in a newline."""
    assert check_target(" 127.0.0.1:50051\n") == "127.0.0.1:50051"
