"""The built wheel works without the checkout: what `pip install rollout_grpc-*.whl` gives a trainer.

`make dist`'s build (PyPA build: the sdist, then the wheel from the sdist) into a temporary
directory; the wheel must hold every file of the package that git tracks (the generated protos and
their stubs, `py.typed`). Then a fresh virtualenv with only that wheel (no `[server]` extra) and the
test runner runs tests/client the way tools/client_matrix.sh does: the replica comes from
tests/client/conftest.py (tools/serve_sim.sh on the dev virtualenv's interpreter), and
`ROLLOUT_CLIENT_SITE` makes that conftest fail the session unless `rollout_grpc` was imported from
the new virtualenv's site-packages rather than from the checkout. tests/client/test_cli.py runs the
installed console script there: `--help`, `--version` and `info` on the client's dependencies
alone. pip's cache is reused, so the only network use is the package index's metadata (and files
the cache does not have yet).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rollout_grpc import __version__
from tests.support.processes import REPO

BUILD_TIMEOUT_S = 300
# The client tests' own dependencies (tools/client_matrix.sh installs the same), and what a user's
# type checker needs to see the client's precise types (mypy with protobuf's and grpc's stubs): the
# typing test then checks the installed wheel (py.typed) the way a user's code sees it.
TEST_DEPS = ["pytest", "pytest-asyncio", "pytest-timeout", "mypy", "types-protobuf", "types-grpcio"]


def run(command: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run `command`, fail the test with its output if it fails; its standard output."""
    proc = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{command} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built as `make dist` builds it (from the sdist), in a temporary directory."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], cwd=out, timeout=BUILD_TIMEOUT_S)
    wheels = sorted(out.glob("rollout_grpc-*.whl"))
    assert [w.name for w in wheels] == [f"rollout_grpc-{__version__}-py3-none-any.whl"]
    assert (out / f"rollout_grpc-{__version__}.tar.gz").is_file()
    return wheels[0]


def test_the_wheel_holds_every_tracked_package_file_and_nothing_else(wheel: Path) -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "rollout_grpc"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert tracked, "git ls-files found no package file"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    missing = sorted(set(tracked) - names)
    assert not missing, f"tracked files missing from the wheel: {missing}"
    dist_info = f"rollout_grpc-{__version__}.dist-info/"
    stray = sorted(n for n in names if not n.startswith(("rollout_grpc/", dist_info)))
    assert not stray, f"files outside the package in the wheel: {stray}"
    assert f"{dist_info}entry_points.txt" in names  # the rollout-grpc console script


@pytest.mark.timeout(BUILD_TIMEOUT_S * 3)
def test_client_tests_pass_on_the_wheel_installed_alone(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # A venv created from the dev venv's interpreter uses its base interpreter, not the dev packages.
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, timeout=BUILD_TIMEOUT_S)
    python = venv / "bin" / "python"
    run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel), *TEST_DEPS],
        cwd=tmp_path,
        timeout=BUILD_TIMEOUT_S,
    )
    # Run from the temporary directory: `python -c` puts the working directory first on sys.path.
    probe = run(
        [
            str(python),
            "-c",
            "import importlib.util as u, sysconfig, rollout_grpc\n"
            "print(sysconfig.get_paths()['purelib'])\n"
            "print(rollout_grpc.__file__)\n"
            "print(u.find_spec('aiohttp') is not None)",
        ],
        cwd=tmp_path,
        timeout=60,
    ).splitlines()
    site, imported, has_aiohttp = probe
    assert Path(site).is_relative_to(venv)
    assert Path(imported).is_relative_to(site)
    assert has_aiohttp == "False", "the client-only install pulled in aiohttp, a server dependency"

    env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUT_GRPC_TARGET", "PYTHONPATH")}
    env |= {"ROLLOUT_SERVER_PYTHON": sys.executable, "ROLLOUT_CLIENT_SITE": site}
    # As tools/client_matrix.sh: the venv's pytest script (its directory first on sys.path, not
    # the checkout), importlib mode, and conftests from tests/client only.
    output = run(
        [
            str(venv / "bin" / "pytest"),
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore::DeprecationWarning",
            "--import-mode=importlib",
            "--confcutdir=tests/client",
            "tests/client",
        ],
        cwd=REPO,
        env=env,
        timeout=BUILD_TIMEOUT_S,
    )
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary), output
    assert "skipped" not in summary and "deselected" not in summary, output


def test_the_install_docs_name_the_current_wheel() -> None:
    """README, docs/ and deploy/ spell out the wheel's file name: it follows the version."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "README.md"]
    named = {
        (path.relative_to(REPO).as_posix(), version)
        for path in docs
        for version in re.findall(r"rollout_grpc-(\d[^-]*)-py3-none-any\.whl", path.read_text())
    }
    assert named, "no document names the wheel"
    stale = sorted(item for item in named if item[1] != __version__)
    assert not stale, f"wheel names of another version than {__version__}: {stale}"
