"""The slime hook reaches a replica with TLS and authentication: token and TLS settings from
`args.rollout_grpc_*` or `$ROLLOUT_GRPC_CLIENT_*`, like the other clients."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_grpc.client.errors import PermissionDeniedError, UnauthenticatedError
from rollout_grpc.integrations import slime, slime_weights
from rollout_grpc.settings import unknown_variables
from tests.harness import running_server, sim_engines
from tests.security.credentials import ADMIN, TRAINER_A, Pki
from tests.support.checkpoints import toy_checkpoint


async def test_the_hook_uses_the_token_and_tls_settings(
    pki: Pki, tokens_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = toy_checkpoint(tmp_path / "ckpt" / "v1", seed=1)
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims],
            tls_cert_file=str(pki.server.cert),
            tls_key_file=str(pki.server.key),
            auth_tokens_file=str(tokens_file),
            weights_path_prefixes=[str(tmp_path / "ckpt")],
        ) as server,
    ):
        target = f"localhost:{server.port}"
        monkeypatch.setenv("ROLLOUT_GRPC_CLIENT_TLS_CA", str(pki.ca.cert))
        no_token = SimpleNamespace(rollout_grpc_target=target)
        with pytest.raises(UnauthenticatedError):
            await slime.update_weights(no_token, str(ckpt), "v1")
        trainer = SimpleNamespace(rollout_grpc_target=target, rollout_grpc_token=TRAINER_A)
        with pytest.raises(PermissionDeniedError):
            await slime.update_weights(trainer, str(ckpt), "v1")  # a trainer may not move the fleet
        token_file = tmp_path / "admin.token"
        token_file.write_text(ADMIN + "\n")
        monkeypatch.setenv("ROLLOUT_GRPC_CLIENT_TOKEN_FILE", str(token_file))
        await slime.update_weights(SimpleNamespace(rollout_grpc_target=target), str(ckpt), "v1")
        assert sims[0].core.version == "v1"


async def test_slime_train_pushes_with_the_same_settings(
    pki: Pki, tokens_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routed update of slime_train (a blocking client in slime's actor) takes the hook's token
    and TLS settings too: refused without the admin token, done with it."""
    sync_dir = tmp_path / "sync"
    async with (
        sim_engines(1) as sims,
        running_server(
            [s.url for s in sims],
            tls_cert_file=str(pki.server.cert),
            tls_key_file=str(pki.server.key),
            auth_tokens_file=str(tokens_file),
            weights_path_prefixes=[str(sync_dir)],
        ) as server,
    ):
        args = SimpleNamespace(
            rollout_grpc_target=f"localhost:{server.port}",
            rollout_grpc_tls_ca=str(pki.ca.cert),
            rollout_grpc_token=TRAINER_A,
            update_weight_disk_dir=str(sync_dir),
        )
        ckpt = toy_checkpoint(slime_weights.version_dir(args, 1), seed=1)
        with pytest.raises(PermissionDeniedError):
            await asyncio.to_thread(slime_weights.push_checkpoint, args, ckpt)
        args.rollout_grpc_token = None
        monkeypatch.setenv("ROLLOUT_GRPC_CLIENT_TOKEN", ADMIN)
        await asyncio.to_thread(slime_weights.push_checkpoint, args, ckpt)
        assert sims[0].core.version == "1"


def test_the_hooks_variables_are_not_reported_as_unknown_settings() -> None:
    environ = {
        "ROLLOUT_GRPC_CLIENT_TOKEN": "x",
        "ROLLOUT_GRPC_CLIENT_TLS_CA": "/ca.pem",
        "ROLLOUT_GRPC_GRASE": "1",
    }
    assert [u.name for u in unknown_variables(environ)] == ["ROLLOUT_GRPC_GRASE"]


def test_mtls_needs_both_files() -> None:
    with pytest.raises(ValueError, match="tls_cert and rollout_grpc_tls_key"):
        slime.credentials_of(SimpleNamespace(rollout_grpc_tls_cert="/c.pem"))
