"""The committed generated code (rollout_grpc/_proto) matches proto/rollout.proto.

Why a test as well as `make test`'s `gen_proto.py --check`: `pytest` alone (an IDE, a CI job that
only runs the suite) must also fail when someone edits the proto and forgets `make proto`, since
the server would then speak an older contract than the one other languages generate from.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "tools" / "gen_proto.py"), "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_generated_code_matches_the_proto() -> None:
    result = run_check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_detects_a_stale_generated_module(tmp_path: Path) -> None:
    """The check is not vacuous: a proto change without regeneration fails it."""
    for rel in ("tools/gen_proto.py", "proto/rollout.proto", "rollout_grpc/_proto"):
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    assert run_check(tmp_path).returncode == 0, "the copy starts in sync"
    proto = tmp_path / "proto" / "rollout.proto"
    proto.write_text(proto.read_text().replace("int32 response_length = 7;", "int32 response_length = 99;"))
    result = run_check(tmp_path)
    assert result.returncode == 1
    assert "stale" in result.stderr and "rollout_pb2.py" in result.stderr
