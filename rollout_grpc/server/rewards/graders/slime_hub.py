"""slime's rule rewards (`--rm-type`), re-implemented to give the same verdicts.

slime (THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515, `slime/rollout/rm_hub/`) scores a
sample by `rm_type`. These functions take the same (label, response) and return the same value;
`tests/unit/test_reward_graders.py` checks them case by case against slime's own functions when
a slime checkout is available (`SLIME_SRC`), and records slime's verdicts in its table otherwise.

* `math`: the last `\\boxed{}` of the response against the label (itself unboxed when boxed):
  1 when the MATH string normalisation or the sympy check says equal, else 0. No box: 0.
* `deepscaler`: the same check on the part after the last `</think>` (or after `###Response`);
  a response with neither scores 0.
* `dapo`: DAPO's Minerva-style check of the last `Answer: ...` line among the last 300 characters
  against an integer label: +1.0 or -1.0, with the extracted prediction.
* `f1`: SQuAD's token F1 of the response against the label (articles, punctuation and case
  ignored; yes/no/noanswer must match exactly).
* `gpqa`: the chosen option letter (A-J) against the label's letter, or the label's text found in
  the response.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from rollout_grpc.server.rewards.graders import hendrycks, sympy_check
from rollout_grpc.server.rewards.graders.boxed import boxed_answer, last_boxed


def _same_answer(given: str, truth: str) -> bool:
    return hendrycks.equal(given, truth) or sympy_check.equal(given, truth)


def math_score(label: str, response: str) -> float:
    """slime's `math` (its `grade_answer_verl`): 1.0 or 0.0."""
    if not label:
        return 0.0
    truth: str | None = label
    if "\\boxed" in label:
        truth = boxed_answer(label)
    given = boxed_answer(response)
    if given is None or truth is None:
        return 0.0
    return 1.0 if _same_answer(given, truth) else 0.0


def deepscaler_score(label: str, response: str) -> float:
    """slime's `deepscaler`: 1.0 or 0.0."""
    if "</think>" in response:
        solution = response.rsplit("</think>", maxsplit=1)[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    given = boxed_answer(solution)
    if given is None or label == "":
        return 0.0
    truth = boxed_answer(label) if "\\boxed" in label else label
    if truth is None:
        return 0.0
    return 1.0 if _same_answer(given, truth) else 0.0


# ----------------------------------------------------------------------------------------- dapo

#: Minerva's answer normalisation (Lewkowycz et al. 2022, appendix D), as DAPO applies it:
#: replacements first, then words and marks removed.
_DAPO_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DAPO_REMOVE = (
    *["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units"],
    "\\ldots",
    *[
        "sue",
        "points",
        "feet",
        "minutes",
        "digits",
        "cents",
        "degrees",
        "cm",
        "gm",
        "pounds",
        "meters",
        "meals",
        "edges",
        "students",
    ],
    *["childrentickets", "multiples"],
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
    "<|im_end|>",
    "<|endoftext|>",
)
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def dapo_normalize(answer: str) -> str:
    """Minerva's normalisation of a final answer (the right-hand side of its last `=`)."""
    answer = answer.rsplit("=", maxsplit=1)[-1]
    for old, new in _DAPO_REPLACE:
        answer = answer.replace(old, new)
    for mark in _DAPO_REMOVE:
        answer = answer.replace(mark, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


@dataclass(frozen=True, slots=True)
class DapoVerdict:
    """slime's `dapo` answer: `score` (+1/-1), `acc`, and the prediction it read."""

    score: float
    acc: bool
    pred: str

    def detail(self) -> dict[str, object]:
        return {"score": self.score, "acc": self.acc, "pred": self.pred}


def dapo_verdict(label: str, response: str) -> DapoVerdict:
    """slime's `dapo`. Raises ValueError when the label is not a number (DAPO's labels are
    integers; slime's reward fails the same way)."""
    tail = response[-300:]
    found = _DAPO_ANSWER.findall(tail)
    pred = dapo_normalize(found[-1] if found else "[INVALID]")
    truth = str(int(float(dapo_normalize(label))))
    correct = pred == truth
    return DapoVerdict(1.0 if correct else -1.0, correct, pred)


# ------------------------------------------------------------------------------------------- f1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")


def _squad_normalize(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_score(label: str, response: str) -> float:
    """slime's `f1` (SQuAD's token F1)."""
    prediction, truth = _squad_normalize(response), _squad_normalize(label)
    if (prediction in _YES_NO or truth in _YES_NO) and prediction != truth:
        return 0.0
    predicted, expected = prediction.split(), truth.split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


# ----------------------------------------------------------------------------------------- gpqa

_LETTERS = string.ascii_uppercase
_CHOICE_PATTERNS = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
    re.compile(r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
)
_LONE_CAPITAL = re.compile(r"\b([A-Z])\b")


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _chosen_letter(response: str, valid: list[str]) -> str | None:
    if not response:
        return None
    text = _after_thinking(response)
    allowed = {v.upper() for v in valid}
    for pattern in _CHOICE_PATTERNS:
        match = pattern.search(text)
        if match and match.group(1).upper() in allowed:
            return str(match.group(1)).upper()
    for letter in reversed(_LONE_CAPITAL.findall(text)):
        if str(letter).upper() in allowed:
            return str(letter).upper()
    return None


def _choices(meta: Mapping[str, object]) -> list[object] | None:
    raw = meta.get("choices")
    if isinstance(raw, Mapping):
        return list(raw.values())
    if isinstance(raw, list | tuple):
        return list(raw)
    return None


def _valid_letters(meta: Mapping[str, object], choices: list[object] | None) -> list[str]:
    raw = meta.get("valid_letters")
    if isinstance(raw, list | tuple | str) and raw:
        return [str(v).upper() for v in raw]
    return list(_LETTERS[: len(choices)] if choices else _LETTERS[:10])


def _correct_letter(
    meta: dict[str, object], label: str, valid: list[str], choices: list[object] | None
) -> str | None:
    given = meta.get("correct_letter")
    letter = given.strip().upper() if isinstance(given, str) else None
    if len(label) == 1 and label.upper() in valid and not letter:
        letter = label.upper()
    if not letter and choices and label:
        for i, choice in enumerate(choices):
            if _words(str(choice)) == _words(label):
                meta.setdefault("correct_answer", choice)
                return valid[i]
    return letter


def _answer_texts(
    meta: Mapping[str, object], label: str, letter: str | None, valid: list[str], choices: list[object] | None
) -> set[str]:
    texts: list[str] = []
    if letter and choices and letter in valid and valid.index(letter) < len(choices):
        texts.append(str(choices[valid.index(letter)]))
    texts += [str(meta[key]) for key in ("correct_answer", "answer_text") if meta.get(key)]
    if label:
        texts.append(label)
    return {_words(t) for t in texts}


def gpqa_score(label: str, response: str, metadata: Mapping[str, object] | None = None) -> float:
    """slime's `gpqa`: 1.0 or 0.0. `metadata` may give `choices`, `valid_letters`,
    `correct_letter`, `correct_answer`, `answer_text` (slime's per-sample metadata)."""
    meta = dict(metadata or {})
    choices = _choices(meta)
    valid = _valid_letters(meta, choices)
    label_text = label.strip()
    correct = _correct_letter(meta, label_text, valid, choices)
    chosen = _chosen_letter(response, valid)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0
    said = _words(_after_thinking(response))
    if any(t and t in said for t in _answer_texts(meta, label_text, correct, valid, choices)):
        return 1.0
    if chosen and not correct and label_text:
        return 1.0 if chosen == label_text.upper() else 0.0
    return 0.0


def dapo_score(label: str, response: str) -> float:
    """slime's `dapo` reward as a number (`score`: +1.0 or -1.0), for `--reward-key score`."""
    return dapo_verdict(label, response).score


def dapo_detail(label: str, response: str) -> dict[str, object]:
    """slime's whole `dapo` answer, `{score, acc, pred}` (slime's `--reward-key score` reads it)."""
    return dapo_verdict(label, response).detail()


def gpqa_label_score(label: str, response: str) -> float:
    """slime's `gpqa` with no per-sample metadata (the label is the letter or the answer text)."""
    return gpqa_score(label, response)


__all__ = [
    "DapoVerdict",
    "dapo_score",
    "dapo_verdict",
    "deepscaler_score",
    "f1_score",
    "gpqa_label_score",
    "gpqa_score",
    "last_boxed",
    "math_score",
]
