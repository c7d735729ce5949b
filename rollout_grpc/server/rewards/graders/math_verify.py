"""`MATH`: answer equivalence with math-verify, used the way its authors document it.

math-verify (HuggingFace) extracts an answer from text with extraction configs and compares two
parsed answers symbolically. Its README parses the gold answer and the model's answer with the same
extraction configs, LaTeX and plain expressions (`LatexExtractionConfig()`, `ExprExtractionConfig()`)
and calls `verify(gold, answer)`; that is done here for both sides.

One thing math-verify does not do is find LaTeX outside math delimiters: in `The answer is
2\\sqrt{2}` its LaTeX extraction sees nothing and the plain-expression extraction reads `2`, so the
wrong answer `2` would be scored right, and `x = 2\\sqrt{2}` wrong against `2\\sqrt{2}`. Model outputs
and dataset labels often carry bare LaTeX, so a text with LaTeX commands and no delimiter at all has
its trailing math (after the last word of prose) delimited with `$...$` before parsing. A text that
already delimits its math (`$`, `\\(`, `\\[`, `\\boxed`) is parsed as it is. A label is a bare
answer by nature, so an undelimited label is delimited whole. When the response has a `\\boxed{}`,
its last one is the answer (as slime and verl read it): math-verify alone reads every box of the
response as a set, so `\\boxed{4}, correcting: \\boxed{5}` would not equal `5`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from rollout_grpc.server.rewards.graders.boxed import last_boxed

_DELIMITERS = ("\\(", "\\[", "\\boxed", "\\fbox")
#: A `$` that delimits math (`\\$` is a dollar sign).
_DOLLAR = re.compile(r"(?<!\\)\$")
_LATEX_COMMAND = re.compile(r"\\(?:[A-Za-z]+|%)")
#: A word of prose: two or more letters that are not a LaTeX command's name.
_PROSE = re.compile(r"[A-Za-z]{2,}")


@lru_cache(maxsize=1)
def _configs() -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(), ExprExtractionConfig()]


def _delimited(text: str) -> bool:
    return bool(_DOLLAR.search(text)) or any(d in text for d in _DELIMITERS)


def _is_prose(token: str) -> bool:
    return bool(_PROSE.search(_LATEX_COMMAND.sub("", token)))


def delimit_bare_latex(text: str) -> str:
    """`text` with its trailing bare LaTeX wrapped in `$...$` (unchanged when it has a math delimiter
    or no LaTeX command)."""
    if _delimited(text) or not _LATEX_COMMAND.search(text):
        return text
    tokens = text.rstrip().rstrip(".").split(" ")
    start = len(tokens)
    while start > 0 and not _is_prose(tokens[start - 1]):
        start -= 1
    math = " ".join(tokens[start:]).strip()
    if not math:
        return text
    head = " ".join(tokens[:start])
    return f"{head} ${math}$".strip()


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return list(parse(text, extraction_config=_configs(), parsing_timeout=None))


def _gold(label: str) -> str:
    """A label is a bare answer: delimited whole unless it delimits its own math."""
    return label if _delimited(label) else f"${label}$"


def _answer(response: str) -> str:
    """The part of a response math-verify should read: its last `\\boxed{}` when it has one (a
    model's final answer; math-verify would read every box as a set), else the response with its
    bare LaTeX delimited."""
    boxed = last_boxed(response)
    if boxed is not None:
        return f"$\\boxed{{{boxed}}}$"
    return delimit_bare_latex(response)


def math_equal(label: str, response: str) -> bool:
    """True when the response's answer is mathematically equal to the label's."""
    from math_verify import verify

    gold = _parse(_gold(label))
    answer = _parse(_answer(response))
    if not gold or not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=None))
