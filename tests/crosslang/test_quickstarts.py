"""The Node.js and TypeScript quick starts in docs/quickstart.md run as written against a live replica.

The blocks are read from the Markdown file; the TypeScript one is compiled with `tsc --strict` first
(typescript and @types/node are dev dependencies in package.json), so a type error in the docs fails
too. The npm packages come from the same `npm ci` as tests/crosslang/test_node_client.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness import Harness, harness
from tests.support.docs import code_blocks

pytestmark = pytest.mark.crosslang

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
QUICKSTART = ROOT / "docs" / "quickstart.md"
TIMEOUT_S = 120  # a safety net against a hung process, not a performance assertion


@pytest.fixture
async def replica() -> AsyncIterator[Harness]:
    async with harness("sim") as running:
        yield running


async def run(*command: str, target: str, cwd: Path) -> str:
    """Run a process without blocking the loop that serves the replica; its stdout."""
    env = {**os.environ, "ROLLOUT_GRPC_TARGET": target, "NODE_PATH": str(HERE / "node_modules")}
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, (
        f"{command[0]} exited with {proc.returncode}:\n{stdout.decode()}{stderr.decode()}"
    )
    return stdout.decode()


def assert_group_printed(stdout: str) -> None:
    lines = [line.split() for line in stdout.strip().splitlines()]
    assert [fields[0] for fields in lines] == ["0", "1", "2", "3"], stdout
    assert all(f[1] in ("SAMPLE_STATUS_COMPLETED", "SAMPLE_STATUS_TRUNCATED") for f in lines), stdout
    assert all(int(f[2]) > 0 for f in lines), stdout


async def test_node_quickstart(node_client: Path, replica: Harness, tmp_path: Path) -> None:
    (code,) = code_blocks(QUICKSTART, "js")
    script = tmp_path / "quickstart.js"
    script.write_text(code)
    assert_group_printed(await run("node", str(script), target=replica.target, cwd=ROOT))


async def test_typescript_quickstart(node_client: Path, replica: Harness, tmp_path: Path) -> None:
    (code,) = code_blocks(QUICKSTART, "ts")
    source_dir = HERE / ".quickstart"  # beside node_modules, so tsc resolves the packages' types
    source_dir.mkdir(exist_ok=True)
    source = source_dir / f"quickstart_{os.getpid()}.ts"
    source.write_text(code)
    try:
        await run(
            str(HERE / "node_modules" / ".bin" / "tsc"),
            "--strict",
            "--target", "es2022",
            "--module", "commonjs",
            "--moduleResolution", "node",
            "--types", "node",
            "--outDir", str(tmp_path),
            str(source),
            target=replica.target,
            cwd=HERE,
        )  # fmt: skip
    finally:
        source.unlink()
    compiled = tmp_path / source.with_suffix(".js").name
    assert_group_printed(await run("node", str(compiled), target=replica.target, cwd=ROOT))
