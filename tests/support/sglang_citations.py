"""Citations of the sglang 0.5.23 wheel in the project's code, found and checked against its source.

Why: the SGLang adapter, the simulator, its conformance shapes (``tests/support/sglang_shapes.py``)
and the device check all say where in SGLang 0.5.23 a behaviour was read. A line that drifts (a
reading of another version, a typo, a range that moved) leaves a claim nobody can check, so
``tests/unit/test_sglang_code_citations.py`` holds these to the rules ``docs/sglang-http-api.md``
is held to: the file exists in the wheel (a unique path), the lines are inside it, and a name the
citation vouches for is on the cited lines.

The code cites in a few shorthands, all read here:

* a path inside the wheel (``managers/tokenizer_manager.py``, ``sglang/srt/…``, ``api/v1/…``), or a
  suffix of one that names a single file, then ``:`` or a space and the lines:
  ``entrypoints/http_server.py:937-939``, ````utils/common.py```` ``3584-3593``;
* an abbreviation of the files cited most (``TM 2624-2660``, ``TM:926``, ``{TM}:2507-2617`` in the
  shapes' f-strings), :data:`ABBREVIATIONS`;
* lists: ``TM 2938, 2973``, ``{HS}:1404-1417,1488-1505``, ``serving.py:58,172,262,274``.

A name in backticks directly before the citation in parentheses (`` `name` (TM 2241) ``, also
``(0.5.23 TM:…`` and `` (`name`, TM 5812)``) is the name the citation vouches for.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Where tools/sglang/fetch_source.sh unpacks the wheel's source (the directory holding ``sglang/``).
SOURCE = Path(os.environ.get("ROLLOUT_SGLANG_SRC") or ROOT / ".cache" / "sglang-0.5.23")

#: The abbreviations the code uses for the files it cites most (paths under ``sglang/srt/``).
ABBREVIATIONS = {
    "TM": "managers/tokenizer_manager.py",
    "HS": "entrypoints/http_server.py",
    "SB": "managers/schedule_batch.py",
    "SCH": "managers/scheduler.py",
    "WV": "utils/weight_versions.py",
    "PROTO": "entrypoints/openai/protocol.py",
}

_ABBR = "|".join(ABBREVIATIONS)
_LINES = r"\d+(?:-\d+)?(?:,[ \t]*(?:\n[ \t]*(?:#[ \t]*)?)?\d+(?:-\d+)?(?![\w.]))*"
#: ``FILE SEP LINES``: FILE an abbreviation (bare, or ``{TM}`` inside an f-string) or a ``.py`` path.
CITATION = re.compile(
    rf"(?:\{{(?P<fabbr>{_ABBR})\}}:|\b(?P<abbr>{_ABBR})[: ]"
    rf"|(?<![\w/.-])(?P<path>[\w/]*\w\.py)(?:``|`)?(?::| |\n[ \t]*(?:#[ \t]*)?))"
    rf"(?P<lines>{_LINES})"
)
#: A name in backticks directly before a citation in parentheses (optionally ``0.5.23 ``).
NAMED = re.compile(r"`+([A-Za-z_][\w.]*)`+(?: \(|, )(?:0\.5\.23 )?`*$")


@dataclass(frozen=True)
class Citation:
    """One cited file and its line ranges, with where it is cited and the name it vouches for."""

    where: str
    cited: str
    path: str
    ranges: tuple[tuple[int, int], ...]
    name: str | None = None

    def __str__(self) -> str:
        named = f" `{self.name}`" if self.name else ""
        return f"{self.where}: {self.cited!r}{named}"


def _ranges(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in re.split(r",\s*(?:#\s*)?", text.strip()):
        first, _, last = part.partition("-")
        out.append((int(first), int(last or first)))
    return tuple(out)


def find(text: str, where: str) -> list[Citation]:
    """Every citation of the wheel in ``text`` (``where`` names the file for messages)."""
    out = []
    for m in CITATION.finditer(text):
        path = m.group("path") or ABBREVIATIONS[m.group("fabbr") or m.group("abbr")]
        line = text.count("\n", 0, m.start()) + 1
        before = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
        named = NAMED.search(before)
        out.append(
            Citation(
                f"{where}:{line}",
                m.group(0).strip(),
                path,
                _ranges(m.group("lines")),
                named.group(1) if named else None,
            )
        )
    return out


@cache
def wheel_files() -> tuple[str, ...]:
    """Every ``.py`` of the unpacked wheel, relative to :data:`SOURCE` (``sglang/srt/…``)."""
    return tuple(sorted(str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.py")))


def resolve(path: str) -> list[str]:
    """The wheel files ``path`` can mean: itself under ``sglang/`` or ``sglang/srt/``, else a suffix."""
    path = path.removeprefix("python/")
    for full in (path, f"sglang/{path}", f"sglang/srt/{path}"):
        if (SOURCE / full).is_file():
            return [full]
    return [f for f in wheel_files() if f.endswith(f"/{path}")]


@cache
def source_lines(path: str) -> list[str]:
    return (SOURCE / path).read_text(encoding="utf-8").splitlines()


def problems(c: Citation) -> list[str]:
    """Every way a citation fails against the wheel (empty when it holds)."""
    files = resolve(c.path)
    if not files:
        return [f"{c}: no such file in the wheel"]
    if len(files) > 1:
        return [f"{c}: {c.path} names {len(files)} files of the wheel ({', '.join(files)})"]
    lines = source_lines(files[0])
    out = [
        f"{c}: {first}-{last} outside {files[0]} ({len(lines)} lines)"
        for first, last in c.ranges
        if not 1 <= first <= last <= len(lines)
    ]
    if not out and c.name is not None:
        word = c.name.rsplit(".", 1)[-1]
        cited = [s for first, last in c.ranges for s in lines[first - 1 : last]]
        if not any(re.search(rf"\b{re.escape(word)}\b", s) for s in cited):
            out.append(f"{c}: `{word}` is not on the cited lines of {files[0]}")
    return out


def cited_text(source: str) -> str:
    """The wheel's lines a ``Shape.source`` string cites (``path:ranges; path:ranges``), joined."""
    out: list[str] = []
    for c in find(source, "shape"):
        files = resolve(c.path)
        if len(files) == 1:
            lines = source_lines(files[0])
            out.extend(s for first, last in c.ranges for s in lines[first - 1 : last])
    return "\n".join(out)
