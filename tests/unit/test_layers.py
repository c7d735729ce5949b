"""The layer rules of docs/architecture.md hold: the import contracts of pyproject.toml pass.

`make lint` runs `lint-imports` too; this test makes `make test` fail on a broken rule as well, and
checks that the contracts really bite: an import that breaks one is reported.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]


def _lint(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LINT, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_the_contracts_are_kept() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_domain_module_importing_grpc_breaks_a_contract(tmp_path: Path) -> None:
    """The same contracts over a copy of the package with one forbidden import added."""
    copy = tmp_path / "rollout_grpc"
    subprocess.run(["cp", "-r", str(ROOT / "rollout_grpc"), str(copy)], check=True)
    (copy / "server" / "domain" / "leak.py").write_text(
        textwrap.dedent(
            """
            import grpc

            from rollout_grpc.server.engines.vllm import adapter
            """
        )
    )
    (tmp_path / ".importlinter").write_text(_contracts_as_ini())
    result = _lint(tmp_path, str(tmp_path / ".importlinter"), "--no-cache")
    assert result.returncode != 0
    assert "the domain imports no transport, no wire format and no engine BROKEN" in " ".join(
        result.stdout.split()
    )


def _contracts_as_ini() -> str:
    """pyproject's [tool.importlinter] contracts in import-linter's INI form."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[importlinter]", "root_packages =\n    rollout_grpc", "include_external_packages = True"]
    for i, contract in enumerate(config["contracts"]):
        lines.append(f"\n[importlinter:contract:{i}]")
        for key, value in contract.items():
            if isinstance(value, list):
                lines.append(f"{key} =\n" + "\n".join(f"    {v}" for v in value))
            else:
                lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def test_a_door_importing_below_the_facade_breaks_a_contract(tmp_path: Path) -> None:
    """The OpenAI door used to pick engines and call adapters itself; an import of the engine
    layer (or a use case) from a door is now reported."""
    copy = tmp_path / "rollout_grpc"
    subprocess.run(["cp", "-r", str(ROOT / "rollout_grpc"), str(copy)], check=True)
    (copy / "server" / "front" / "openai" / "leak.py").write_text(
        "from rollout_grpc.server.engines.api import EngineError\n"
    )
    (tmp_path / ".importlinter").write_text(_contracts_as_ini())
    result = _lint(tmp_path, str(tmp_path / ".importlinter"), "--no-cache")
    assert result.returncode != 0
    assert "the doors go down through the facade only BROKEN" in " ".join(result.stdout.split())
