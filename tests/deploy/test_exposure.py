"""A replica on a network address starts only protected, or on a network declared trusted.

`rollout-grpc serve --host 0.0.0.0` used to start with nothing but a warning, without
authentication (anyone reaching the pod network could Pause every trainer), or with bearer tokens
in plaintext. It now refuses with one line naming what to add, unless `--insecure-trusted-network`
says every host that can reach the address is trusted. Nothing listens on a network address here:
`serve` refuses before it opens or binds anything.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rollout_grpc.server.exposure import ExposureRefused, check_exposure, is_loopback
from tests.support.processes import replica_command

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::ffff:127.0.0.1", True),
        ("localhost.attacker.example", False),
        ("127.example.com", False),
        ("::1.attacker.example", False),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("rollout.rl.svc", False),
    ],
)
def test_is_loopback_parses_the_host_exactly(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_tokens_without_tls_on_a_network_address_are_refused() -> None:
    with pytest.raises(ExposureRefused, match="bearer tokens cross the network unencrypted"):
        check_exposure("0.0.0.0", auth=True, tokens=True, tls=False, trusted=False)
    with pytest.raises(ExposureRefused, match="authentication is off"):
        check_exposure("0.0.0.0", auth=False, tokens=False, tls=True, trusted=False)
    with pytest.raises(ExposureRefused):
        check_exposure("localhost.attacker.example", auth=False, tokens=False, tls=False, trusted=False)
    check_exposure("0.0.0.0", auth=True, tokens=True, tls=True, trusted=False)  # protected: starts
    check_exposure("0.0.0.0", auth=False, tokens=False, tls=False, trusted=True)  # declared trusted
    check_exposure("127.0.0.1", auth=False, tokens=False, tls=False, trusted=False)


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*replica_command(), "serve", "--sim", "1", "--port", "0", "--health-port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_serve_on_a_network_address_without_auth_exits_naming_the_flag() -> None:
    done = _serve("--host", "0.0.0.0")
    assert done.returncode != 0
    assert "authentication is off" in done.stderr and "--insecure-trusted-network" in done.stderr


def test_serve_with_tokens_in_plaintext_on_a_network_address_exits(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("trainer trainer some-long-random-token\n")
    done = _serve("--host", "0.0.0.0", "--auth-tokens-file", str(tokens))
    assert done.returncode != 0
    assert "bearer tokens cross the network unencrypted" in done.stderr
    assert "--tls-cert/--tls-key" in done.stderr
