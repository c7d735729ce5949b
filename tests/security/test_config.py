"""Security flags and environment variables reach ServerConfig; exposed setups are warned about."""

from __future__ import annotations

import argparse

import pytest
import structlog

from rollout_grpc import settings
from rollout_grpc.server.app import RolloutServer, ServerConfig
from rollout_grpc.server.exposure import ExposureRefused


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_serve_arguments(parser)
    return settings.parse_serve_args(parser, argv)


def test_flags_and_env_vars_fill_the_security_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_GRPC_TLS_CERT", "/secrets/tls.crt")
    monkeypatch.setenv("ROLLOUT_GRPC_TLS_KEY", "/secrets/tls.key")
    monkeypatch.setenv("ROLLOUT_GRPC_AUTH_TOKENS_FILE", "/secrets/tokens")
    args = parse(
        [
            "--tls-client-ca=/secrets/ca.crt",
            "--mtls-role=ops.example=admin",
            "--mtls-role=a.example=trainer",
            "--max-abort-ids=7",
            "--max-in-flight-per-caller=3",
            "--control-rate=0",
            "--no-reflection",
        ]
    )
    config = settings.server_config(args, ["http://engine:8000"])
    assert (config.tls_cert_file, config.tls_key_file) == ("/secrets/tls.crt", "/secrets/tls.key")
    assert config.tls_client_ca_file == "/secrets/ca.crt"
    assert config.auth_tokens_file == "/secrets/tokens"
    assert config.mtls_roles == {"ops.example": "admin", "a.example": "trainer"}
    assert config.max_abort_ids == 7 and config.per_caller_limit() == 3
    assert config.control_rate_per_s == 0 and not config.reflection
    tls = config.tls()
    assert tls is not None and tls.mutual


def test_bad_security_flags_are_refused() -> None:
    with pytest.raises(settings.SettingsError, match="--mtls-role"):
        settings.server_config(parse(["--mtls-role=nobody"]), [])
    with pytest.raises(ValueError, match="go together"):
        ServerConfig(engines=[], tls_cert_file="x.crt").tls()
    with pytest.raises(ValueError, match="needs --tls-cert"):
        ServerConfig(engines=[], tls_client_ca_file="ca.crt").tls()
    with pytest.raises(ValueError, match="needs --tls-client-ca"):
        RolloutServer(ServerConfig(engines=[], mtls_roles={"a": "trainer"}))


def test_default_share_is_half_of_slots_and_queue() -> None:
    config = ServerConfig(engines=["http://e:1", "http://e:2"], server_concurrency=10, max_queue=30)
    assert config.per_caller_limit() == (20 + 30) // 2


def test_network_address_without_auth_or_tls_starts_only_on_a_trusted_network() -> None:
    with pytest.raises(ExposureRefused, match="--insecure-trusted-network"):
        RolloutServer(ServerConfig(engines=[], host="0.0.0.0"))._check_exposure(None)
    with structlog.testing.capture_logs() as logs:
        trusted = ServerConfig(engines=[], host="0.0.0.0", insecure_trusted_network=True)
        RolloutServer(trusted)._check_exposure(None)
        RolloutServer(ServerConfig(engines=[], host="127.0.0.1"))._check_exposure(None)
    events = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert events == ["UNAUTHENTICATED_SERVICE_ON_NETWORK", "PLAINTEXT_SERVICE_ON_NETWORK"]
