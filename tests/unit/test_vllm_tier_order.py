"""The vLLM tier runs its tests grouped by server kind, so each server starts once per run.

Why: in file order the tier interleaved dense, moe and vl tests, and the server manager (at most
``ROLLOUT_VLLM_MAX_SERVERS`` servers, least recently used evicted) restarted servers again and again
(8 starts of ~40 s each). The sort key of tests/vllm/fixtures.py is checked here against the real
manager's eviction, with servers that only pretend to start.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.vllm.fixtures import _server_order
from tests.vllm.servers import ModelKind, VllmServer, VllmServerManager

#: The kinds each test of a tier needs, in file order: modules alternate between kinds.
DENSE: list[ModelKind] = ["dense"]
FILE_ORDER: list[list[ModelKind]] = [
    *[DENSE] * 5,
    ["vl"],
    ["dense"],
    ["moe"],
    ["dense"],
    ["dense", "moe"],
    ["vl"],
    [],
    ["moe"],
    ["dense"],
    ["vl"],
    ["dense"],
]


class PretendServer(VllmServer):
    """Starts and stops without a process."""

    alive = False

    def start(self, timeout_s: float) -> None:
        self.alive = True

    def running(self) -> bool:
        return self.alive

    def stop(self, grace_s: float = 20.0) -> None:
        self.alive = False


class PretendManager(VllmServerManager):
    def _new_server(self, kind: ModelKind) -> VllmServer:
        return PretendServer(kind=kind, port=0, log_path=self.log_dir / f"{kind}.log")


def starts(order: list[list[ModelKind]], max_servers: int, tmp_path: Path) -> dict[ModelKind, int]:
    manager = PretendManager(log_dir=tmp_path, max_servers=max_servers)
    for kinds in order:
        manager.ensure(kinds)
    return manager.starts


@pytest.mark.parametrize("max_servers", [1, 2, 3])
def test_grouped_order_starts_each_server_once(max_servers: int, tmp_path: Path) -> None:
    grouped = sorted(FILE_ORDER, key=_server_order)
    assert starts(grouped, max_servers, tmp_path) == {"dense": 1, "moe": 1, "vl": 1}


def test_file_order_restarts_servers(tmp_path: Path) -> None:
    """The check above can fail: the same tests in file order restart servers."""
    assert sum(starts(FILE_ORDER, 2, tmp_path).values()) > 3


def test_tests_without_a_server_come_first_and_groups_are_contiguous() -> None:
    grouped = sorted(FILE_ORDER, key=_server_order)
    assert grouped[0] == []
    runs = [kinds for kinds, _ in itertools.groupby(tuple(k) for k in grouped)]
    assert len(runs) == len(set(runs)), f"a kind set appears in two separate runs: {runs}"
