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


def test_the_wiring_importing_the_settings_breaks_a_contract(tmp_path: Path) -> None:
    """The server reads `server/config.py` only; the wiring reaching for a flag (the settings'
    table) is reported, as the doors' doing so was."""
    copy = tmp_path / "rollout_grpc"
    subprocess.run(["cp", "-r", str(ROOT / "rollout_grpc"), str(copy)], check=True)
    (copy / "server" / "leak.py").write_text("from rollout_grpc.settings.table import FLAGS\n")
    (tmp_path / ".importlinter").write_text(_contracts_as_ini())
    result = _lint(tmp_path, str(tmp_path / ".importlinter"), "--no-cache")
    assert result.returncode != 0
    assert "the server imports nothing of the settings" in " ".join(result.stdout.split())


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


def _change_rows() -> list[tuple[str, str, list[str], int]]:
    """(change, canary, listed files, count) of docs/architecture.md's "How many files" table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### How many files a change touches", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[1].startswith("`"):
            continue
        files = [name.strip().strip("`") for name in cells[2].split(",")]
        rows.append((cells[0], cells[1].strip("`"), files, int(cells[3])))
    return rows


def _product_files_naming(word: str) -> set[str]:
    """Product files (proto and package, generated code left out) whose text names `word`."""
    found: set[str] = set()
    for path in [ROOT / "proto" / "rollout.proto", *sorted((ROOT / "rollout_grpc").rglob("*.py"))]:
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("rollout_grpc/_proto/"):
            continue
        if word.lower() in path.read_text().lower():
            found.add(relative)
    return found


def test_the_files_a_change_touches_are_the_ones_the_architecture_names() -> None:
    """A vocabulary named in one more file (a hand-written mapping, a copied list) fails here
    until it is derived again or the table says so."""
    rows = _change_rows()
    assert {change for change, *_ in rows} == {"a sampling knob", "a reward kind"}
    for change, canary, listed, count in rows:
        assert len(listed) == count, f"{change}: the count says {count}, the row lists {len(listed)}"
        found = _product_files_naming(canary)
        for entry in listed:
            covered = {f for f in found if f == entry or (entry.endswith("/") and f.startswith(entry))}
            assert covered, f"{change}: {entry} no longer names {canary}: drop it from the table"
            found -= covered
        assert not found, f"{change}: {sorted(found)} name {canary} too: derive it, or list it in the table"
