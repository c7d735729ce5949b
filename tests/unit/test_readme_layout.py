"""README's Layout section names only paths that exist.

Before, it named nine server modules (service.py, rollout.py, engines.py, vllm.py, openai_front.py,
...) that had long become packages. Each entry is `PATH  description`; a path named in a description
(`app.py`, `front/`, `grpc/`) is looked up under the entry's path and under the directories named
before it in the same entry (most recent first), then from the repository root (`docs/x.md`).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.processes import REPO

#: A path-like word: one with a slash, or a file name with an extension the tree uses.
PATH_WORD = re.compile(
    r"(?<![\w./-])(?:[\w.-]+/)+(?:[\w.-]+)?"  # with a slash
    r"|(?<![\w./-])[\w-]+\.(?:py|md|sh|proto|toml|yaml|json)\b"  # a file name
)


def layout_entries(readme: str) -> list[tuple[str, str]]:
    """(path, description) of each entry of the Layout code block; continuation lines joined."""
    section = readme.split("\n## Layout\n", 1)[1]
    block = section.split("```\n", 2)[1]
    entries: list[tuple[str, str]] = []
    for line in block.splitlines():
        if line.startswith(" "):
            path, text = entries[-1]
            entries[-1] = (path, f"{text} {line.strip()}")
        else:
            path, _, text = line.partition(" ")
            entries.append((path, text.strip()))
    return entries


def missing_paths(entries: list[tuple[str, str]], root: Path) -> list[str]:
    """The entries' paths, and the paths their descriptions name, that do not exist under `root`."""
    missing: list[str] = []
    for path, text in entries:
        if not (root / path).exists():
            missing.append(path)
            continue
        bases = [root / path if (root / path).is_dir() else (root / path).parent]
        for word in PATH_WORD.findall(text):
            found = next((b / word for b in [*reversed(bases), root] if (b / word).exists()), None)
            if found is None:
                missing.append(f"{path}: {word}")
            elif found.is_dir():
                bases.append(found)
    return missing


def test_every_path_in_the_readme_layout_exists() -> None:
    entries = layout_entries((REPO / "README.md").read_text())
    assert len(entries) >= 10
    assert not missing_paths(entries, REPO), missing_paths(entries, REPO)


def test_the_check_finds_a_module_that_is_gone() -> None:
    """The old entry: `service.py` sits in front/grpc/, not in server/; rollout.py is gone."""
    old = [("rollout_grpc/server/", "service.py (transport) → rollout.py (domain); security/ (auth.py)")]
    gone = ["rollout_grpc/server/: service.py", "rollout_grpc/server/: rollout.py"]
    assert missing_paths(old, REPO) == gone
