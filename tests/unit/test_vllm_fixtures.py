"""The vLLM tier's URL fixtures never hand a test the address of a server that was stopped meanwhile.

Why: at most ROLLOUT_VLLM_MAX_SERVERS servers run at once, so the manager evicts one to start
another. A session-cached ``vllm_dense_url`` kept answering with the evicted server's address: in a
whole-tier run the vLLM slime-hook scenarios, which ask for the fixture dynamically after the MoE
and VL tests had evicted the dense server, all failed with "no healthy engine" (connection refused).
Each test must get its URL from the manager, which restarts an evicted server.

An inner pytest session runs the real plugin against a fake manager whose every answer is a new
address (a server started again); no vLLM is needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

INNER_CONFTEST = '''
from tests.vllm import fixtures


class FakeManager:
    """Answers every URL request with a new port, as after a restart elsewhere."""

    def __init__(self):
        self.calls = 0
        self.events = []
        self.starts = {"dense": 0, "moe": 0, "vl": 0}  # read by the tier's end-of-run summary

    def running_kinds(self):
        return ["dense", "moe", "vl"]

    def url(self, kind, keep=()):
        self.calls += 1
        return f"http://127.0.0.1:{8000 + self.calls}"

    def ensure(self, kinds):
        pass

    def stop_all(self):
        pass


FAKE = FakeManager()
fixtures.manager = lambda: FAKE
fixtures.skip_reason = lambda: None
'''

INNER_TESTS = """
SEEN = []


def test_first(vllm_dense_url):
    SEEN.append(vllm_dense_url)


def test_second_asks_the_manager_again(vllm_dense_url):
    assert SEEN and vllm_dense_url != SEEN[0]


def test_dynamic_request_asks_the_manager_again(request):
    assert request.getfixturevalue("vllm_dense_url") not in SEEN
"""


def test_each_test_gets_its_url_from_the_manager(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    plugins = ["-p", "no:cacheprovider", "-p", "tests.vllm.fixtures"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, "-c", str(tmp_path / "pytest.ini"), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout, result.stdout
