"""docs/sglang-http-api.md cites SGLang 0.5.23 by file and line, and every citation holds.

Why: the SGLang adapter and simulator follow that document, and the document follows the released
0.5.23 wheel's source (SGLang cannot run here). A citation that drifts — a wrong line, a file of
another version, a pointer to an older commit or a third-party copy — would let a statement stand
that nobody can check. So:

* every ``sglang/<path>.py`` in the document carries ``:<line>`` or ``:<first>-<last>``;
* the document points at no SGLang commit and no copy other than the 0.5.23 wheel;
* it ends with the section "What stays unverified";
* against the unpacked wheel (``tools/sglang/fetch_source.sh``: ``$ROLLOUT_SGLANG_SRC``, default
  ``.cache/sglang-0.5.23``), every cited file exists, every cited line is inside it, and where a
  name in backticks directly precedes a citation in parentheses (`` `name` (`path.py:N`) ``), the
  name is on the cited line or in the cited range.

The last check needs the source and skips without it; ``.ci/run`` fetches it (pip download from
PyPI, ~1 s from the pip cache) so that under ``CI=true`` it always runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "sglang-http-api.md"
#: Where tools/sglang/fetch_source.sh unpacks the wheel's source (the directory holding ``sglang/``).
SOURCE = Path(os.environ.get("ROLLOUT_SGLANG_SRC") or ROOT / ".cache" / "sglang-0.5.23")
#: slime's pinned commit is cited on purpose: slime is the client, not SGLang.
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"

#: Any mention of a file of the wheel (``sglang/…py``), not part of a longer path or name.
MENTION = re.compile(r"(?<![\w/.-])sglang/[\w/]+\.py\b(?::[\w-]*)?")
CITATION = re.compile(r"(?<![\w/.-])(sglang/[\w/]+\.py):(\d+)(?:-(\d+))?(?![\w-])")
#: `` `name` (`citation`` ``: the name a citation vouches for.
NAMED = re.compile(r"`([A-Za-z_][\w.]*)` \(`(sglang/[\w/]+\.py):(\d+)(?:-(\d+))?`")


@dataclass(frozen=True)
class Citation:
    doc_line: int
    path: str
    first: int
    last: int
    name: str | None = None

    def __str__(self) -> str:
        span = f"{self.first}" if self.first == self.last else f"{self.first}-{self.last}"
        named = f" `{self.name}`" if self.name else ""
        return f"docs/sglang-http-api.md:{self.doc_line}: {self.path}:{span}{named}"


def _lines() -> list[str]:
    return DOC.read_text(encoding="utf-8").splitlines()


def citations() -> list[Citation]:
    out: list[Citation] = []
    for n, line in enumerate(_lines(), start=1):
        for m in CITATION.finditer(line):
            first = int(m.group(2))
            out.append(Citation(n, m.group(1), first, int(m.group(3) or first)))
        for m in NAMED.finditer(line):
            first = int(m.group(3))
            out.append(Citation(n, m.group(2), first, int(m.group(4) or first), m.group(1)))
    return out


@cache
def _source_lines(path: str) -> list[str] | None:
    file = SOURCE / path
    return file.read_text(encoding="utf-8").splitlines() if file.is_file() else None


def test_the_document_cites_the_wheel_throughout() -> None:
    cites = citations()
    # Every section cites; a rewrite that drops the citations must fail here, not pass vacuously.
    assert len({c.doc_line for c in cites}) >= 150, len(cites)
    assert sum(1 for c in cites if c.name) >= 40


def test_every_mention_of_a_wheel_file_has_a_line() -> None:
    bad = []
    for n, line in enumerate(_lines(), start=1):
        for m in MENTION.finditer(line):
            if not CITATION.fullmatch(m.group(0)):
                bad.append(f"docs/sglang-http-api.md:{n}: {m.group(0)!r} is not path.py:line[-line]")
    assert bad == []


def test_ranges_run_forward() -> None:
    assert [str(c) for c in citations() if c.last < c.first] == []


def test_no_older_commit_and_no_copy_is_cited() -> None:
    text = DOC.read_text(encoding="utf-8")
    shas = set(re.findall(r"\b[0-9a-f]{40}\b", text)) - {SLIME_COMMIT}
    assert shas == set(), "only the 0.5.23 wheel is cited for SGLang"
    for phrase in ("third-party", "HS*", "python/sglang/", "upstream commit", "older versions"):
        assert phrase not in text, phrase


def test_the_last_section_lists_what_stays_unverified() -> None:
    headings = [line for line in _lines() if line.startswith("## ")]
    assert headings[-1] == "## 12. What stays unverified"
    section = DOC.read_text(encoding="utf-8").split(headings[-1], 1)[1]
    items = re.findall(r"^\d+\. \*\*", section, flags=re.M)
    assert len(items) >= 5, "each unverified item is numbered and says why"


def test_every_citation_holds_in_the_unpacked_wheel() -> None:
    if _source_lines("sglang/srt/managers/tokenizer_manager.py") is None:
        pytest.skip(f"no unpacked sglang 0.5.23 source at {SOURCE}: run tools/sglang/fetch_source.sh")
    problems = []
    for c in citations():
        lines = _source_lines(c.path)
        if lines is None:
            problems.append(f"{c}: no such file in the wheel")
        elif not 1 <= c.first <= c.last <= len(lines):
            problems.append(f"{c}: outside the file ({len(lines)} lines)")
        elif c.name is not None:
            word = c.name.rsplit(".", 1)[-1]
            if not any(re.search(rf"\b{re.escape(word)}\b", s) for s in lines[c.first - 1 : c.last]):
                problems.append(f"{c}: `{word}` is not on the cited line(s)")
    assert problems == []
