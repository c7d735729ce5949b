"""The last `\\boxed{...}` of a text, the way slime's rule rewards find it.

slime (THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515, `slime/rollout/rm_hub/math_utils.py`)
takes the last occurrence of `\\boxed` (or `\\fbox` when there is none), follows the braces from
there to the first point where they balance, and keeps the inside only when that span is exactly
`\\boxed{...}`. So `\\boxed 5` or an unclosed box has no answer, and a nested box counts as a whole.
"""

from __future__ import annotations

_OPEN = "\\boxed{"


def _last_box_span(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        char = text[end]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start : end + 1]
    return None


def last_boxed(text: str) -> str | None:
    """The inside of the text's last `\\boxed{...}`, or None (no box, unclosed, or `\\fbox`)."""
    span = _last_box_span(text)
    if span is None or not span.startswith(_OPEN) or not span.endswith("}"):
        return None
    return span[len(_OPEN) : -1]


def boxed_answer(text: str) -> str | None:
    """slime's `extract_answer`: the last box's inside, only for a text that has `\\boxed` at all."""
    return last_boxed(text) if "\\boxed" in text else None
