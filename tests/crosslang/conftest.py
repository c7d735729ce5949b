"""The Node.js client, installed once per session for the cross-language tests."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CLIENT_JS = HERE / "client.js"
STAMP = HERE / "node_modules" / ".rollout-grpc-lock.sha256"


def _lock_digest() -> str:
    return hashlib.sha256(
        (HERE / "package.json").read_bytes() + (HERE / "package-lock.json").read_bytes()
    ).hexdigest()


@pytest.fixture(scope="session")
def node_client() -> Path:
    """client.js with its pinned npm packages installed (`npm ci`, skipped when already done)."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the Node.js cross-language client cannot run")
    digest = _lock_digest()
    if not (STAMP.exists() and STAMP.read_text().strip() == digest):
        # --ignore-scripts: protobufjs' postinstall only checks its optional CLI; nothing needs it.
        result = subprocess.run(
            ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if result.returncode != 0:
            pytest.fail(f"npm ci failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        STAMP.write_text(digest + "\n")
    return CLIENT_JS
