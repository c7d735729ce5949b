"""The Python quick starts in the docs run as written against a live replica.

The code blocks are read from the Markdown files themselves, so an edit that breaks the docs fails
here. (The Node.js and TypeScript blocks: tests/crosslang/test_quickstarts.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.docs import code_blocks

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "ROLLOUT_GRPC_TARGET": target},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_python_quickstart(target: str) -> None:
    code, _ = code_blocks(ROOT / "docs" / "quickstart.md", "python")
    result = run_python(code, target)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")[:-1]
    assert [line.split()[0] for line in lines] == ["0", "1", "2", "3"]
    assert all(line.split()[1] in ("SAMPLE_STATUS_COMPLETED", "SAMPLE_STATUS_TRUNCATED") for line in lines)


def test_python_errors_quickstart(target: str) -> None:
    _, code = code_blocks(ROOT / "docs" / "quickstart.md", "python")
    result = run_python(code, target)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "sampling_params.top_p - must be in (0, 1], got 2.0\n"


def test_readme_python_example(target: str) -> None:
    blocks = code_blocks(ROOT / "README.md", "python")
    assert blocks, "README.md has a Python example"
    for code in blocks:
        assert "127.0.0.1:50051" in code
        result = run_python(code.replace("127.0.0.1:50051", target), target)
        assert result.returncode == 0, result.stderr
        assert "SAMPLE_STATUS_" in result.stdout
