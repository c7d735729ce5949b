"""String normalisation of MATH answers (Hendrycks et al., the MATH dataset's grader).

slime's `math` and `deepscaler` rewards accept an answer when this normalisation of it equals the
label's (or when the sympy check in `sympy_check.py` does). The rules, in the order they apply:
drop line breaks and `\\!`, `\\\\` -> `\\`, `tfrac`/`dfrac` -> `frac`, drop `\\left`/`\\right`, degree
marks and `\\$`, cut a trailing unit written as `\\text{ ...}`, drop `\\%`, write a leading `.` as
`0.`, drop a short left-hand side (`x = 5` -> `5`), brace `\\sqrt3` and `\\frac12`, drop spaces, and
write `0.5` and `a/b` as fractions. A rule that cannot apply to a malformed answer (two unit
markers, a `\\sqrt` or `\\frac` with nothing after it) leaves the answer un-normalised, as the
original does.
"""

from __future__ import annotations

import re

_TEXT_ONLY = re.compile(r"^\\text\{(?P<text>.+?)\}$")


class _Malformed(Exception):
    """An answer the rules cannot normalise: it is compared as given."""


def _cut_right_unit(s: str) -> str:
    marker = "\\text{ "
    if marker not in s:
        return s
    parts = s.split(marker)
    if len(parts) != 2:
        raise _Malformed(s)
    return parts[0]


def _brace_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    out = [head]
    for part in rest:
        if not part:
            raise _Malformed(s)
        out.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


def _brace_fracs(s: str) -> str:
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        if not part:
            raise _Malformed(s)
        if part[0] == "{":
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return s  # `\frac1`: left as it was
        numerator, second, tail = part[0], part[1], part[2:]
        if second != "{":
            out.append("\\frac{" + numerator + "}{" + second + "}" + tail)
        else:
            out.append("\\frac{" + numerator + "}" + second + tail)
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _rules(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    s = _cut_right_unit(s)
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _brace_sqrt(s).replace(" ", "")
    s = _brace_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def normalize(answer: str) -> str:
    """The normalised answer (the answer itself, stripped, when the rules cannot apply)."""
    answer = answer.strip()
    match = _TEXT_ONLY.search(answer)
    if match is not None:
        answer = match.group("text").strip()
    try:
        return _rules(answer)
    except (_Malformed, IndexError):
        return answer


def equal(given: str, truth: str) -> bool:
    """The two answers normalise to the same string."""
    return normalize(truth) == normalize(given)
