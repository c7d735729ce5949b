"""The server refuses an interpreter or dependencies it is not tested on, saying what to install.

(The console script in a client-only install is checked for real by tools/client_matrix.sh.)
"""

from __future__ import annotations

import pytest

from rollout_grpc.server import environment


def test_the_dev_environment_can_run_the_server() -> None:
    assert environment.problems() == []


def test_an_untested_python_is_named_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(environment.ALLOW_ENV, raising=False)
    monkeypatch.setattr(environment, "SERVER_PYTHON", (3, 99))
    with pytest.raises(RuntimeError, match=r"runs on Python 3\.99.*pip install 'rollout-grpc\[server\]'"):
        environment.require_server_environment()
    monkeypatch.setenv(environment.ALLOW_ENV, "1")
    environment.require_server_environment()


def test_old_or_missing_dependencies_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "SERVER_MINIMUMS", {"grpcio": (99, 0, 0), "not-a-dist": (1,)})
    monkeypatch.setattr(environment, "SERVER_MODULES", {"not_a_module_xyz": "xyz-dist"})
    found = environment.problems()
    assert any(p.startswith("grpcio ") and "older than the server's 99.0.0" in p for p in found)
    assert "not-a-dist is not installed" in found
    assert "missing server dependencies: xyz-dist" in found
