"""`rollout-grpc info` against a replica with TLS, mTLS and bearer tokens (flags and env vars)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from rollout_grpc.cli import main
from rollout_grpc.server.security.redact import engine_label
from tests.harness import running_server, sim_engines
from tests.security.credentials import ADMIN, TRAINER_A, Pki

pytestmark = pytest.mark.timeout(120)


def _token_file(tmp_path: Path, token: str) -> str:
    path = tmp_path / f"token-{token}"
    path.write_text(token + "\n")
    return str(path)


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d ")


async def _info(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the CLI's `info` (blocking gRPC: off the loop that serves the replica); its output
    without the in-process replica's log lines."""
    code = await asyncio.to_thread(main, ["info", *argv])
    captured = capsys.readouterr()
    out = "\n".join(line for line in captured.out.splitlines() if not _LOG_LINE.match(line))
    return code, out, captured.err


async def test_info_reaches_a_tls_replica_with_a_token(
    pki: Pki, tokens_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims],
            tls_cert_file=str(pki.server.cert),
            tls_key_file=str(pki.server.key),
            auth_tokens_file=str(tokens_file),
        ) as server,
    ):
        target = ["--target", f"localhost:{server.port}", "--timeout", "5"]
        url = sims[0].url

        code, _, err = await _info(capsys, *target)
        assert code == 2 and "UNAVAILABLE" in err  # plaintext to a TLS port

        code, _, err = await _info(capsys, *target, "--tls-ca", str(pki.ca.cert))
        assert code == 2 and "UNAUTHENTICATED" in err

        admin = _token_file(tmp_path, ADMIN)
        code, out, _ = await _info(capsys, *target, "--tls-ca", str(pki.ca.cert), "--token-file", admin)
        assert code == 0 and f"{url}  vllm  yes" in out and "health SERVING" in out

        trainer = _token_file(tmp_path, TRAINER_A)
        code, out, _ = await _info(
            capsys, *target, "--json", "--tls-ca", str(pki.ca.cert), "--token-file", trainer
        )
        assert code == 0
        assert [e["url"] for e in json.loads(out)["engines"]] == [engine_label(url)]

        code, _, err = await _info(
            capsys, *target, "--tls-ca", str(pki.ca.cert), "--token-file", "/nonexistent"
        )
        assert code == 2 and "/nonexistent" in err


async def test_info_takes_its_credentials_from_the_environment_and_does_mtls(
    pki: Pki, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims],
            tls_cert_file=str(pki.server.cert),
            tls_key_file=str(pki.server.key),
            tls_client_ca_file=str(pki.ca.cert),
            mtls_roles={"ops.admins.example": "admin"},
        ) as server,
    ):
        target = ["--target", f"localhost:{server.port}", "--timeout", "5"]
        monkeypatch.setenv("ROLLOUT_GRPC_INFO_TLS_CA", str(pki.ca.cert))
        code, _, err = await _info(capsys, *target)
        assert code == 2 and "UNAVAILABLE" in err  # no client certificate: the handshake fails

        code, _, err = await _info(capsys, *target, "--tls-cert", str(pki.ops.cert))
        assert code == 2 and "--tls-key" in err

        monkeypatch.setenv("ROLLOUT_GRPC_INFO_TLS_CERT", str(pki.ops.cert))
        monkeypatch.setenv("ROLLOUT_GRPC_INFO_TLS_KEY", str(pki.ops.key))
        code, out, _ = await _info(capsys, *target)
        assert code == 0 and f"{sims[0].url}  vllm  yes" in out


async def test_info_sends_the_token_from_the_environment_over_plaintext_loopback(
    tokens_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        sim_engines(1) as sims,
        running_server([s.url for s in sims], auth_tokens_file=str(tokens_file)) as server,
    ):
        target = ["--target", f"127.0.0.1:{server.port}", "--timeout", "5"]
        code, _, err = await _info(capsys, *target)
        assert code == 2 and "UNAUTHENTICATED" in err
        monkeypatch.setenv("ROLLOUT_GRPC_INFO_TOKEN", ADMIN)
        code, out, _ = await _info(capsys, *target)
        assert code == 0 and f"{sims[0].url}  vllm  yes" in out
