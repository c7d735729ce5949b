"""Every citation of the sglang 0.5.23 wheel outside docs/sglang-http-api.md holds in its source.

Why: the SGLang adapter, the simulator, the shapes the simulator is held to
(``tests/support/sglang_shapes.py``), the tests and ``tools/sglang`` cite SGLang 0.5.23 by file and
line, and a drifted line lets a claim stand that nobody can check (docs/sglang-http-api.md is
checked by ``test_sglang_doc_citations.py``). The rules are the document's: the file exists in the
wheel (a path that names one file), every cited line is inside it, and a name in backticks directly
before a citation is on the cited lines (``tests/support/sglang_citations.py`` reads the shorthands).
The shapes are held to more: every key of a shape and every text value it fixes is in the lines its
``source`` cites, so a shape cannot point at lines that do not build it.

The checks against the source skip without the unpacked wheel (``tools/sglang/fetch_source.sh``);
``.ci/run`` fetches it, so under ``CI=true`` they always run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import sglang_citations as sc
from tests.support import sglang_shapes

ROOT = sc.ROOT
#: Where code citing the wheel lives (the doc and its own test are checked elsewhere).
TREES = ("rollout_grpc", "tests", "tools", "bench")
SKIP = {
    "tests/unit/test_sglang_doc_citations.py",
    "tests/unit/test_sglang_code_citations.py",  # its examples of the shorthands
    "tests/support/sglang_citations.py",
}
#: Values a shape fixes that the source computes rather than spells: the expression it uses.
DERIVED = {("validation error", "type"): "HTTPStatus.BAD_REQUEST.phrase"}
#: Files known to cite the wheel: the scan must find citations in each (a scan that finds none
#: would pass vacuously).
MUST_CITE = (
    "tests/support/sglang_shapes.py",
    "rollout_grpc/server/engines/sglang/adapter.py",
    "rollout_grpc/server/engines/sglang/info.py",
    "rollout_grpc/server/engines/sglang/wire.py",
    "rollout_grpc/sim/sglang/state.py",
    "rollout_grpc/sim/sglang/params.py",
    "rollout_grpc/sim/sglang/discovery.py",
    "tools/sglang/device_check.sh",
)

needs_source = pytest.mark.skipif(
    not (sc.SOURCE / "sglang/srt/managers/tokenizer_manager.py").is_file(),
    reason=f"no unpacked sglang 0.5.23 source at {sc.SOURCE}: run tools/sglang/fetch_source.sh",
)


def _citing_files() -> list[Path]:
    """Files that say they read SGLang 0.5.23, or that cite by the shapes' abbreviations."""
    out = []
    for tree in TREES:
        for file in sorted((ROOT / tree).rglob("*")):
            rel = str(file.relative_to(ROOT))
            if file.suffix not in (".py", ".sh", ".md") or rel in SKIP or ".venv" in file.parts:
                continue
            text = file.read_text(encoding="utf-8")
            if "0.5.23" in text or rel.startswith(("rollout_grpc/server/engines/sglang/", "tools/sglang/")):
                out.append(file)
    return out


def _citations() -> list[sc.Citation]:
    out: list[sc.Citation] = []
    for file in _citing_files():
        out.extend(sc.find(file.read_text(encoding="utf-8"), str(file.relative_to(ROOT))))
    return out


def test_the_scan_finds_the_citing_files() -> None:
    cites = _citations()
    citing = {c.where.rsplit(":", 1)[0] for c in cites}
    assert set(MUST_CITE) <= citing, set(MUST_CITE) - citing
    assert len(cites) >= 100 and sum(1 for c in cites if c.name) >= 8, len(cites)


def test_the_shapes_abbreviations_are_the_checkers() -> None:
    text = (ROOT / "tests/support/sglang_shapes.py").read_text(encoding="utf-8")
    defined = dict(re.findall(r'^([A-Z]+) = "([\w/]+\.py)"$', text, flags=re.M))
    assert defined == {k: v for k, v in sc.ABBREVIATIONS.items() if k in defined}
    assert len(defined) >= 5


def test_the_reader_understands_the_shorthands() -> None:
    # The checker must read every form the code uses; each of these is one citation.
    text = (
        "``_handle_abort_req`` (TM 3601, 3603-3628)\n"
        'f"{HS}:1404-1417,1488-1505"\n'
        "(TM:926,\n    938, 2241-2253)\n"
        "``utils/common.py`` 3584-3593\n"
        "(``to_finish``, SCH 5812)\n"
        "validate (0.5.23 managers/tokenizer_manager.py:1353-1378)\n"
        "(``multimodal/processors/base_processor.py``\n    1293-1309)\n"
    )
    found = sc.find(text, "t")
    assert [(c.path, c.ranges, c.name) for c in found] == [
        ("managers/tokenizer_manager.py", ((3601, 3601), (3603, 3628)), "_handle_abort_req"),
        ("entrypoints/http_server.py", ((1404, 1417), (1488, 1505)), None),
        ("managers/tokenizer_manager.py", ((926, 926), (938, 938), (2241, 2253)), None),
        ("utils/common.py", ((3584, 3593),), None),
        ("managers/scheduler.py", ((5812, 5812),), "to_finish"),
        ("managers/tokenizer_manager.py", ((1353, 1378),), None),
        ("multimodal/processors/base_processor.py", ((1293, 1309),), None),
    ]


@needs_source
def test_every_citation_holds_in_the_unpacked_wheel() -> None:
    problems = [p for c in _citations() for p in sc.problems(c)]
    assert problems == []


def _shapes() -> list[sglang_shapes.Shape]:
    return [v for v in vars(sglang_shapes).values() if isinstance(v, sglang_shapes.Shape)]


@needs_source
def test_every_shape_is_built_on_the_lines_it_cites() -> None:
    problems = []
    for shape in _shapes():
        text = sc.cited_text(shape.source)
        for key, _ in shape.keys:
            # A dict key ("key" / 'key'), a subscript, or a dataclass field (``key: type``).
            if not re.search(rf"""["']{re.escape(key)}["']|^\s*{re.escape(key)}\s*:""", text, flags=re.M):
                problems.append(f"{shape.name} ({shape.source}): key {key!r} is not on the cited lines")
        for key, value in shape.values.items():
            if isinstance(value, str) and DERIVED.get((shape.name, key), value) not in text:
                problems.append(f"{shape.name} ({shape.source}): {key}={value!r} is not on the cited lines")
    assert len(_shapes()) >= 20
    assert problems == []
