"""The entries docs/architecture.md says an engine kind is ("How many files a change touches"):
its `engines/<kind>/` package, its member of `domain/vocabulary.EngineKind` with its entry in
`engines/registry.KINDS` (tests/unit/test_vocabularies.py), its package in `pyproject.toml`'s
import contracts, and a simulator personality. A kind name is too common a word to grep the
product for, so each entry is checked here by what holds it: a kind added without one of them
fails, and so does a package under `engines/` that is no kind."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import rollout_grpc.server.engines as engines_pkg
from rollout_grpc.server.domain.vocabulary import EngineKind
from rollout_grpc.sim.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
ENGINES = Path(engines_pkg.__file__).parent
KINDS = {kind.value for kind in EngineKind}


def _contracts() -> dict[str, dict[str, Any]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c for c in data["tool"]["importlinter"]["contracts"]}


def test_every_kind_is_a_package_under_engines_and_nothing_else_is() -> None:
    packages = {p.parent.name for p in ENGINES.glob("*/__init__.py")}
    assert packages == KINDS
    assert all((ENGINES / kind / "adapter.py").is_file() for kind in KINDS)


def test_every_kind_is_in_the_import_contracts() -> None:
    contracts = _contracts()
    layers = contracts["engines: the registry knows the kinds; kinds sit on the neutral pool and API"][
        "layers"
    ]
    kind_layer = next(layer for layer in layers if "|" in layer)
    assert {name.strip() for name in kind_layer.split("|")} == KINDS
    above_api = contracts["an engine kind imports nothing above the engine API"]["source_modules"]
    assert set(above_api) == {f"rollout_grpc.server.engines.{kind}" for kind in KINDS}
    no_kind = set(
        contracts["use cases and the facade import no transport and no engine kind"]["forbidden_modules"]
    )
    assert {f"rollout_grpc.server.engines.{kind}" for kind in KINDS} <= no_kind


def test_the_simulator_serves_every_kind() -> None:
    kind_action = next(a for a in build_parser()._actions if "--kind" in a.option_strings)
    assert set(kind_action.choices or ()) == KINDS
