"""A user's mypy sees the clients' precise types: the installed package ships `py.typed` (PEP 561).

`make lint` checks tests/client/typed_usage.py from inside the source tree, where mypy reads the
package as local code whether or not it is marked typed. Here mypy runs where a user's would: on
a copy of the snippet outside the tree, finding `rollout_grpc` as an installed package. Without
`py.typed` it skips the package ("missing library stubs or py.typed marker") and every result
is `Any`, which the snippet's `assert_type`s reject.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import rollout_grpc

SNIPPET = Path(__file__).with_name("typed_usage.py")


def test_the_package_is_marked_typed() -> None:
    assert (Path(rollout_grpc.__file__).parent / "py.typed").is_file()


def test_a_users_mypy_sees_precise_types(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is a dev tool (not in the client matrix's virtualenvs)")
    usage = tmp_path / "usage.py"
    usage.write_text(SNIPPET.read_text())
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--config-file", "", str(usage)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found in 1 source file" in result.stdout
