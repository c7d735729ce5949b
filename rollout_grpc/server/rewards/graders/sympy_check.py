"""Symbolic equality of two MATH answers (the check slime's `math` and `deepscaler` rewards add to
the string normalisation of `hendrycks.py`).

An answer is normalised for sympy: a whole `\\text{...}` unwrapped, `$` and `%` dropped, `or`/`and`
read as commas, `million`/`billion`/`trillion` as powers of ten, common units dropped, an outer pair
of braces dropped, an integral float written as an integer, LaTeX turned into plain text
(pylatexenc) with its root, pi, infinity, union, dot and times signs spelled out, a mixed
number `7 3/4` read as `7+3/4`, spaces and
braces dropped, lower case, and thousands separators dropped from an integer.

Two normalised answers are equal when they are the same string, or element by element for tuples
and intervals (the same brackets, the same count): two fractions must be written the same (an
unreduced fraction is wrong), an integer only equals an integer, and anything else is equal when
sympy simplifies the difference to 0. Expressions with more than two unknown letters, or exponents
that could make sympy hang (`^{`, `^(`, `^12`, `^2^`), are not given to sympy.

sympy's parser evaluates Python: it runs with no builtins, over sympy's own names only, and callers
run these graders where a runaway expression can be stopped (rewards/rules.py).
"""

from __future__ import annotations

import contextlib
import re
from functools import lru_cache
from typing import Any

_TEXT_ONLY = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_UNITS = [
    "degree",
    "centimeter",
    "cm",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
]
_UNIT_PATTERNS = [re.compile(rf"{unit}(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS]
_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_TUPLE_BRACKETS = "()[]"
_RISKY_EXPONENTS = ("^{", "^(")
_RISKY_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_PLAIN_SYMBOLS = {
    "\u221a": "sqrt",  # square root
    "\u03c0": "pi",
    "\u221e": "inf",
    "\u222a": "U",  # union
    "\u00b7": "*",  # middle dot
    "\u00d7": "*",  # times
}


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except (ValueError, OverflowError):
        return None


def _near_int(value: float) -> bool:
    try:
        return abs(value - round(value)) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _drop_thousands(text: str) -> str:
    while True:
        dropped = _THOUSANDS.sub(r"\1\3\4", text)
        if dropped == text:
            return text
        text = dropped


def _is_int_text(text: str) -> bool:
    value = _as_float(_drop_thousands(text))
    return value is not None and _near_int(value)


def _latex_to_text(expr: str) -> str:
    from pylatexenc import latex2text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    text = str(latex2text.LatexNodes2Text().latex_to_text(expr))
    for symbol, spelled in _PLAIN_SYMBOLS.items():
        text = text.replace(symbol, spelled)
    return text.strip()


def normalize(expr: str) -> str:
    """The answer as sympy will read it (see the module docstring)."""
    match = _TEXT_ONLY.search(expr)
    if match is not None:
        expr = match.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNIT_PATTERNS:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    value = _as_float(expr)
    if value is not None and _near_int(value):
        expr = str(round(value))
    if "\\" in expr:
        with contextlib.suppress(Exception):  # pylatexenc gives up on some input: keep the LaTeX
            expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_int_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _elements(expr: str) -> list[str]:
    expr = _drop_thousands(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if (
        len(expr) > 2
        and expr[0] in _TUPLE_BRACKETS
        and expr[-1] in _TUPLE_BRACKETS
        and not any(b in inner for b in _TUPLE_BRACKETS)
    ):
        return [e.strip() for e in inner.split(",")]
    return [expr]


def _safe_for_sympy(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or any(r in expr for r in _RISKY_EXPONENTS):
        return False
    return not any(p.search(expr) for p in _RISKY_PATTERNS)


@lru_cache(maxsize=1)
def _sympy_names() -> dict[str, Any]:
    import sympy

    return {"__builtins__": {}, **{k: v for k, v in vars(sympy).items() if not k.startswith("_")}}


def _sympy_zero(truth: str, given: str) -> bool:
    import sympy
    from sympy.parsing import sympy_parser

    difference = f"({truth})-({given})"
    if not _safe_for_sympy(difference):
        return False
    try:
        parsed = sympy_parser.parse_expr(
            difference.replace("^", "**"),
            local_dict={},
            global_dict=_sympy_names(),
            transformations=(
                *sympy_parser.standard_transformations,
                sympy_parser.implicit_multiplication_application,
            ),
        )
        return bool(sympy.simplify(parsed) == 0)
    except Exception:  # not an expression sympy reads: not equal
        return False


def _element_equal(truth: str, given: str) -> bool:
    if _FRACTION.search(truth) and _FRACTION.search(given):
        return truth == given
    if _is_int_text(truth) != _is_int_text(given):
        return False
    return _sympy_zero(truth, given)


def equal(given: str, truth: str) -> bool:
    """`given` equals `truth` by the rules of the module docstring."""
    t, g = normalize(truth), normalize(given)
    if t == g:
        return True
    if not g:
        return False
    t_elems, g_elems = _elements(t), _elements(g)
    if len(t_elems) > 1 and (t[0] != g[0] or t[-1] != g[-1]):
        return False
    if len(t_elems) != len(g_elems):
        return False
    return all(_element_equal(a, b) for a, b in zip(t_elems, g_elems, strict=True))
