"""Repository rules that no linter checks.

* No tracked file points outside the repository: a reader of a clone cannot open the notes or
  absolute paths of the machine it was built on. Facts such notes held live in ``docs/``
  (``docs/vllm-http-api.md``, ``docs/rollout-semantics.md``).
* No test module imports another test module (or a conftest): shared helpers live in
  ``tests/support/`` (or are helper modules such as ``tests/harness.py``), so running or deleting one
  test file never changes another.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

import rollout_grpc

REPO = Path(__file__).resolve().parents[2]

#: What a reference outside the repository looks like (this file, which spells the patterns out, is exempt).
OUTSIDE = re.compile(
    "|".join(
        [
            r"/work/",  # the build machine's work tree
            r"/root/",
            r"/home/[A-Za-z]",
            r"\.\./shared\b",
            r"\bshared/(?:reference|design)",
            r"\breference/(?:vllm|rollout|grpc|peers)",
            r"(?<!docs/)\b(?:vllm-http-api|rollout-semantics)\.md",  # only the copies in docs/
            r"\bgrpc-practices\b",
            r"\bpeers\.md\b",
            r"\bdesign\.md\b",
        ]
    )
)


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:  # e.g. an sdist without .git
        pytest.fail(f"git ls-files failed in {REPO}: {exc}")
    paths = [REPO / name for name in out.decode().split("\0") if name]
    return [p for p in paths if p.is_file() and b"\0" not in p.read_bytes()[:8192]]


def test_no_tracked_file_references_files_outside_the_repository() -> None:
    offenders = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if match := OUTSIDE.search(line):
                offenders.append(
                    f"{path.relative_to(REPO)}:{number}: {match.group(0)!r} in {line.strip()[:120]}"
                )
    assert not offenders, "references outside the repository (bring the facts into docs/):\n" + "\n".join(
        offenders
    )


@pytest.mark.parametrize(
    "line",
    [
        "see /work/shared/reference/vllm-http-api.md §3",
        "as in rollout-semantics.md §2",
        "copied from `reference/vllm-golden/`",
        "grpc-practices §5.7",
        "../shared/design.md",
    ],
)
def test_the_pattern_catches_outside_references(line: str) -> None:
    assert OUTSIDE.search(line)


@pytest.mark.parametrize("line", ["docs/vllm-http-api.md §10", "(docs/rollout-semantics.md §2)", "/tmp/x"])
def test_the_pattern_allows_references_into_docs(line: str) -> None:
    assert not OUTSIDE.search(line)


def _imported_modules(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_no_test_module_imports_another_test_module() -> None:
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for module in _imported_modules(tree):
            last = module.rsplit(".", 1)[-1]
            if module.startswith("tests.") and (last.startswith("test_") or last == "conftest"):
                offenders.append(f"{path.relative_to(REPO)} imports {module}")
    assert not offenders, "move shared helpers to tests/support/:\n" + "\n".join(offenders)


def test_the_version_is_defined_once_and_released_versions_have_a_changelog_section() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"], "the version lives in __init__.py"
    assert importlib.metadata.version("rollout-grpc") == rollout_grpc.__version__
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), flags=re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert rollout_grpc.__version__ in headings[1:], (
        f"CHANGELOG.md has no section for {rollout_grpc.__version__}"
    )
