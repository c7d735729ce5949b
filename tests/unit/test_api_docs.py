"""docs/api.md is generated from the proto comments and cannot drift from proto/rollout.proto.

Why: the reference is what trainers in other languages read; a field added, renumbered or
re-documented in the proto without regenerating the docs fails here.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rollout_grpc.client import pb

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "tools" / "gen_api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def test_regenerating_docs_gives_no_diff() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_api_docs.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generation_is_deterministic() -> None:
    assert gen.generate_reference() == gen.generate_reference()


def _section(name: str, text: str) -> str:
    """The Markdown of one `### name` definition, up to the next anchor."""
    start = text.index(f'<a name="rollout.v1.{name}"></a>')
    end = text.find("<a name=", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_every_rpc_message_field_and_enum_value_is_documented() -> None:
    """Cross-check against the descriptor the server runs with, not against the generator itself."""
    text = DOC.read_text()
    file = pb.DESCRIPTOR
    for method in file.services_by_name["RolloutService"].methods:
        assert f'<a name="rollout.v1.RolloutService.{method.name}"></a>' in text
    for message in file.message_types_by_name.values():
        section = _section(message.name, text)
        for field in message.fields:
            row = re.search(rf"^\| `{field.name}` \| {field.number} \|.*\| (.+) \|$", section, re.M)
            assert row, f"{message.name}.{field.name} is missing from docs/api.md"
            assert row.group(1).strip(), f"{message.name}.{field.name} has no description"
    for enum in file.enum_types_by_name.values():
        section = _section(enum.name, text)
        for value in enum.values:
            assert re.search(rf"^\| `{value.name}` \| {value.number} \| .+ \|$", section, re.M), value.name


def test_hand_written_sections_are_kept() -> None:
    text = DOC.read_text()
    tail = text[text.index(gen.END) :]
    for heading in (
        "## Error codes",
        "## Calling from another language",
        "### Go",
        "### Rust (tonic)",
        "### C++",
        "### TypeScript",
    ):
        assert heading in tail
    for code in (
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "NOT_FOUND",
        "UNAVAILABLE",
        "RESOURCE_EXHAUSTED",
        "DEADLINE_EXCEEDED",
        "INTERNAL",
        "google.rpc.BadRequest",
        "RetryInfo",
        "grpc-retry-pushback-ms",
    ):
        assert code in tail


def _proto_copy(tmp_path: Path) -> Path:
    shutil.copy2(ROOT / "proto" / "rollout.proto", tmp_path / "rollout.proto")
    return tmp_path / "rollout.proto"


def test_a_changed_comment_changes_the_docs(tmp_path: Path) -> None:
    proto = _proto_copy(tmp_path)
    proto.write_text(proto.read_text().replace("// Number of response tokens", "// Count of response tokens"))
    changed = gen.generate_reference(tmp_path)
    assert changed != gen.generate_reference()
    assert "Count of response tokens" in changed


def test_an_undocumented_field_is_an_error(tmp_path: Path) -> None:
    proto = _proto_copy(tmp_path)
    proto.write_text(
        proto.read_text().replace("  // Number of response tokens (the tail of `tokens`).\n", "")
    )
    with pytest.raises(gen.MissingComments, match=r"field Sample\.response_length"):
        gen.generate_reference(tmp_path)


def test_markers_are_required() -> None:
    with pytest.raises(ValueError, match="markers"):
        gen.render("# no markers here\n", "x\n")
    page = f"head\n{gen.BEGIN}\nold\n{gen.END}\ntail\n"
    assert gen.render(page, "new\n") == f"head\n{gen.BEGIN}\n\nnew\n\n{gen.END}\ntail\n"
