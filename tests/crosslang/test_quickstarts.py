"""The Node.js and TypeScript quick starts in docs/quickstart.md run as written against a live replica.

The blocks are read from the Markdown file; the TypeScript one is compiled and run with the commands
of its section's shell block, as written (typescript and @types/node are dev dependencies in
package.json), so a type error in the docs, or a command that no longer works with the current
compiler, fails too. The npm packages come from the same `npm ci` as test_node_client.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness import Harness, harness
from tests.support.docs import BLOCK, code_blocks

pytestmark = pytest.mark.crosslang

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
QUICKSTART = ROOT / "docs" / "quickstart.md"
TIMEOUT_S = 120  # a safety net against a hung process, not a performance assertion


@pytest.fixture
async def replica() -> AsyncIterator[Harness]:
    async with harness("sim") as running:
        yield running


def strict_node_options() -> str:
    """NODE_OPTIONS that make this Node run a `.js` file as its package.json says, as Node 18 and 20
    before 20.19 do: newer ones re-run an ES module in a CommonJS package with only a warning."""
    flag = "--no-experimental-detect-module"
    probe = subprocess.run(
        ["node", "-p", f"process.allowedNodeEnvironmentFlags.has({flag!r})"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return flag if probe.stdout.strip() == "true" else ""


async def run(*command: str, target: str, cwd: Path, node_options: str = "") -> str:
    """Run a process without blocking the loop that serves the replica; its stdout."""
    env = {
        **os.environ,
        "NODE_OPTIONS": node_options,
        "ROLLOUT_GRPC_TARGET": target,
        "ROLLOUT_PROTO_DIR": str(ROOT / "proto"),
        "NODE_PATH": str(HERE / "node_modules"),
    }
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


def typescript_commands() -> tuple[list[str], list[list[str]]]:
    """The TypeScript section's shell block: the packages its `npm i` lines install, and the
    commands after them (compile, run), split as a shell would."""
    section = QUICKSTART.read_text().split("\n## TypeScript\n", 1)[1].split("\n## ", 1)[0]
    (block,) = [body for lang, body in BLOCK.findall(section) if lang == "bash"]
    packages: list[str] = []
    commands: list[list[str]] = []
    for line in block.strip().splitlines():
        words = shlex.split(line)
        if words[:2] == ["npm", "i"]:
            packages += [w for w in words[2:] if not w.startswith("-")]
        else:
            commands.append(words)
    return packages, commands


def test_the_typescript_quickstart_installs_what_the_tests_pin() -> None:
    """The `npm i` lines stand for the pinned `npm ci` of package.json: the same packages."""
    packages, commands = typescript_commands()
    manifest = json.loads((HERE / "package.json").read_text())
    assert sorted(packages) == sorted([*manifest["dependencies"], *manifest["devDependencies"]])
    assert [c[:2] for c in commands] == [["npx", "tsc"], ["node", "quickstart.js"]]


async def test_typescript_quickstart(node_client: Path, replica: Harness) -> None:
    """The doc's compile and run commands, as written, with the current TypeScript (package.json).

    Before, the doc said `tsc --strict` while this test added four flags of its own; TypeScript 7
    emits ES modules by default, and one of those flags (`--moduleResolution node`) is removed. The
    doc's old `tsc --strict quickstart.ts; node quickstart.js` fails here with "Cannot use import
    statement outside a module" (`strict_node_options`)."""
    (code,) = code_blocks(QUICKSTART, "ts")
    _, commands = typescript_commands()
    # A directory of its own below this one: tsc and node find node_modules by walking up, as in
    # the reader's project directory; package.json here has no "type", as `npm i` leaves it.
    workdir = HERE / ".quickstart" / str(os.getpid())
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        (workdir / "quickstart.ts").write_text(code)
        strict = strict_node_options()
        outputs = [
            await run(*command, target=replica.target, cwd=workdir, node_options=strict)
            for command in commands
        ]
    finally:
        shutil.rmtree(workdir)
    assert_group_printed(outputs[-1])
