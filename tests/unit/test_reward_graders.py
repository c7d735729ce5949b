"""The rule rewards against a table of realistic model outputs, with slime's own verdicts beside ours.

`MATH_CASES` rows are (label, response, right, slime_math): `right` is whether the response's final
answer is the label's (what `REWARD_KIND_MATH`, math-verify used as its authors document, must say);
`slime_math` is the verdict of slime's `--rm-type math` grader (`grade_answer_verl`), which
`REWARD_KIND_SLIME_MATH` must reproduce, wrong or right (slime reads only the last `\\boxed{}`).
`SLIME_CASES` rows are (kind, label, response, slime's value) for `dapo`, `deepscaler`, `f1`, `gpqa`.

The slime columns were recorded by running slime's own functions (THUDM/slime
624b824a898ab0ec1fcb4d373004c7f3852bf515, `slime/rollout/rm_hub/`). With `SLIME_SRC` set to a
slime checkout, `test_the_recorded_slime_verdicts_are_slimes` re-runs slime's code on every row, so
the recorded column cannot drift from slime; without it that test is skipped (slime is not a
dependency of this project and its code is not copied here).
"""

from __future__ import annotations

import pytest

from rollout_grpc.server.rewards.graders import slime_hub
from rollout_grpc.server.rewards.graders.math_verify import math_equal
from tests.support import slime_rm_hub

# fmt: off
MATH_CASES = [
    ('2', 'The answer is 2\\sqrt{2}', False, 0.0),
    ('3', '3\\pi', False, 0.0),
    ('2\\sqrt{2}', 'x = 2\\sqrt{2}', True, 0.0),
    ('2\\sqrt{2}', '\\sqrt{8}', True, 0.0),
    ('2', 'The answer is 2.', True, 0.0),
    ('2', 'So the final answer is $\\boxed{2}$.', True, 1.0),
    ('2', '$\\boxed{3}$', False, 0.0),
    ('\\frac{1}{2}', '\\boxed{0.5}', True, 1.0),
    ('\\frac{1}{2}', 'The probability is $\\frac{1}{2}$.', True, 0.0),
    ('\\frac{1}{2}', '\\boxed{\\frac{2}{4}}', True, 0.0),
    ('\\frac{1}{2}', '\\boxed{\\dfrac{1}{2}}', True, 1.0),
    ('\\frac{1}{2}', '\\boxed{1/2}', True, 1.0),
    ('0.25', '\\boxed{\\frac{1}{4}}', True, 1.0),
    ('0.25', '\\boxed{25\\%}', True, 0.0),
    ('10', '\\boxed{10\\text{ cm}}', True, 1.0),
    ('10', 'The length is \\boxed{10} cm.', True, 1.0),
    ('10', 'The length is 10 cm.', True, 0.0),
    ('12', '\\boxed{12^\\circ}', True, 1.0),
    ('5', '\\boxed{x = 5}', True, 1.0),
    ('5', '$x = 5$', True, 0.0),
    ('5', 'x = 5', True, 0.0),
    ('-3', '\\boxed{-3}', True, 1.0),
    ('-3', '\\boxed{3}', False, 0.0),
    ('1000', '\\boxed{1,000}', True, 1.0),
    ('1000', '\\boxed{1000.0}', True, 1.0),
    ('3.14', '\\boxed{\\pi}', False, 0.0),
    ('\\pi', '\\boxed{\\pi}', True, 1.0),
    ('2\\pi', '\\boxed{2\\pi}', True, 1.0),
    ('2\\pi', 'The circumference is $2\\pi$ units.', True, 0.0),
    ('\\sqrt{3}', '\\boxed{\\sqrt3}', True, 1.0),
    ('\\sqrt{3}', '\\boxed{3^{1/2}}', True, 0.0),
    ('\\frac{\\sqrt{3}}{2}', '\\boxed{\\frac{\\sqrt{3}}{2}}', True, 1.0),
    ('\\frac{\\sqrt{3}}{2}', '$\\sin 60^\\circ = \\frac{\\sqrt{3}}{2}$', True, 0.0),
    ('[1,2)', 'The solution set is $[1, 2)$.', True, 0.0),
    ('[1,2)', '\\boxed{[1,2)}', True, 1.0),
    ('[1,2)', '\\boxed{(1,2)}', False, 0.0),
    ('(-\\infty, 3]', '\\boxed{(-\\infty,3]}', True, 1.0),
    ('(-\\infty, 3]', '\\boxed{x \\le 3}', False, 0.0),
    ('(2, 3)', '\\boxed{(2,3)}', True, 1.0),
    ('(2, 3)', '\\boxed{(3,2)}', False, 0.0),
    ('2, 3', '\\boxed{2, 3}', True, 1.0),
    ('2, 3', 'The roots are $x = 2$ and $x = 3$.', True, 0.0),
    ('2, 3', '\\boxed{3, 2}', True, 0.0),
    ('x^2+2x+1', '\\boxed{(x+1)^2}', True, 1.0),
    ('x^2+2x+1', '\\boxed{x^2+2x+2}', False, 0.0),
    ('6', '\\boxed{\\binom{4}{2}}', True, 0.0),
    ('24', '\\boxed{4!}', True, 0.0),
    ('\\frac{7}{3}', '\\boxed{2\\frac{1}{3}}', True, 1.0),
    ('\\frac{7}{3}', '\\boxed{2.333}', False, 0.0),
    ('0.333', '\\boxed{\\frac{1}{3}}', False, 0.0),
    ('\\text{(B)}', '\\boxed{\\text{(B)}}', True, 1.0),
    ('B', '\\boxed{B}', True, 1.0),
    ('yes', '\\boxed{\\text{yes}}', True, 1.0),
    ('5', "I think it's 5. Answer: 5", True, 0.0),
    ('5', 'Let me compute. 2+3 = 5. \\boxed{5}', True, 1.0),
    ('5', '\\boxed{5', False, 0.0),
    ('5', '\\fbox{5}', False, 0.0),
    ('5', 'The first answer was \\boxed{4}, but correcting: \\boxed{5}', True, 1.0),
    ('5', '\\boxed{5} is wrong; the answer is \\boxed{6}', False, 0.0),
    ('\\boxed{5}', '\\boxed{5}', True, 1.0),
    ('e', '\\boxed{e}', True, 1.0),
    ('1', '\\boxed{e^{i\\pi}+2}', False, 0.0),
    ('2\\sqrt{2}', '\\boxed{2 \\sqrt{2}}', True, 1.0),
    ('2\\sqrt{2}', '\\boxed{\\sqrt{8}}', True, 1.0),
    ('50\\%', '\\boxed{50}', True, 1.0),
    ('50\\%', '\\boxed{0.5}', True, 0.0),
    ('\\$5', '\\boxed{\\$5}', True, 1.0),
    ('\\$5', '\\boxed{5}', True, 1.0),
    ('3', '\\boxed{3.0}', True, 1.0),
    ('3', '\\boxed{3.01}', False, 0.0),
    ('1/3', '\\boxed{\\frac{1}{3}}', True, 1.0),
    ('4', '<think>2+2 is 4</think> The answer is \\boxed{4}', True, 1.0),
]
SLIME_CASES = [
    ('dapo', '5', 'Let me think.\nAnswer: 5', 1.0),
    ('dapo', '5', 'Answer: $5$', 1.0),
    ('dapo', '5', 'Answer: x = 5', 1.0),
    ('dapo', '5', 'Answer: 6', -1.0),
    ('dapo', '1000', 'Answer: 1,000', 1.0),
    ('dapo', '34', 'Answer: 34 degrees', 1.0),
    ('dapo', '5', 'The answer is 5', -1.0),
    ('dapo', '5', 'Answer: 4\nActually, Answer: 5', 1.0),
    ('dapo', '5', 'answer : \\boxed{5}', 1.0),
    ('dapo', '12', 'Answer: 12 students', 1.0),
    ('deepscaler', '4', '<think>2+2</think>So \\boxed{4}', 1.0),
    ('deepscaler', '4', 'So \\boxed{4}', 0.0),
    ('deepscaler', '4', '<think>maybe \\boxed{4}</think> the answer is 5', 0.0),
    ('deepscaler', '\\boxed{\\frac{1}{2}}', '<think>x</think>\\boxed{0.5}', 1.0),
    ('deepscaler', '4', '###Response \\boxed{4}', 1.0),
    ('f1', 'Barack Obama', 'barack obama', 1.0),
    ('f1', 'Barack Obama', 'The answer is Barack Obama.', 0.6667),
    ('f1', 'the Eiffel Tower', 'Eiffel Tower', 1.0),
    ('f1', 'yes', 'no', 0.0),
    ('f1', 'yes', 'Yes!', 1.0),
    ('f1', 'New York City', 'York', 0.5),
    ('f1', 'Paris', 'London', 0.0),
    ('gpqa', 'C', 'The answer is C', 1.0),
    ('gpqa', 'C', 'The answer is (B).', 0.0),
    ('gpqa', 'C', '<think>A or C?</think> Final answer: C', 1.0),
    ('gpqa', 'C', 'I pick option c', 1.0),
    ('gpqa', 'C', 'C is correct', 1.0),
    ('gpqa', 'mitochondria', 'It happens in the mitochondria.', 1.0),
    ('gpqa', 'B', 'Neither A nor B; I choose D', 0.0),
]
# fmt: on

OURS = {
    "dapo": slime_hub.dapo_score,
    "deepscaler": slime_hub.deepscaler_score,
    "f1": slime_hub.f1_score,
    "gpqa": slime_hub.gpqa_label_score,
}


def test_the_table_is_large_and_covers_both_verdicts() -> None:
    assert len(MATH_CASES) + len(SLIME_CASES) >= 60
    assert {right for _, _, right, _ in MATH_CASES} == {True, False}
    # Cases where the two math kinds disagree are the point of having both.
    assert sum(right != bool(slime) for _, _, right, slime in MATH_CASES) >= 10


@pytest.mark.parametrize(("label", "response", "right", "slime"), MATH_CASES)
def test_math_verify_reads_the_final_answer(label: str, response: str, right: bool, slime: float) -> None:
    assert math_equal(label, response) is right


@pytest.mark.parametrize(("label", "response", "right", "slime"), MATH_CASES)
def test_slime_math_gives_slimes_verdict(label: str, response: str, right: bool, slime: float) -> None:
    assert slime_hub.math_score(label, response) == slime


@pytest.mark.parametrize(("kind", "label", "response", "slime"), SLIME_CASES)
def test_slime_kinds_give_slimes_value(kind: str, label: str, response: str, slime: float) -> None:
    assert OURS[kind](label, response) == pytest.approx(slime, abs=1e-4)


def test_dapo_keeps_slimes_detail_and_refuses_a_label_that_is_not_a_number() -> None:
    verdict = slime_hub.dapo_verdict("5", "Answer: x = 5")
    assert verdict.detail() == {"score": 1.0, "acc": True, "pred": "5"}
    with pytest.raises(ValueError):
        slime_hub.dapo_verdict("five", "Answer: 5")


def test_gpqa_reads_the_choices_from_metadata() -> None:
    meta = {"choices": ["red", "green", "blue"]}
    assert slime_hub.gpqa_score("blue", "I choose C", meta) == 1.0
    assert slime_hub.gpqa_score("blue", "I choose A", meta) == 0.0


def _slime_value(hub: dict[str, object], kind: str, label: str, response: str) -> float:
    module = hub
    if kind == "math":
        return 1.0 if module["math_utils"].grade_answer_verl(response, label) else 0.0  # type: ignore[attr-defined]
    if kind == "dapo":
        return float(module["math_dapo_utils"].compute_score(response, label)["score"])  # type: ignore[attr-defined]
    if kind == "deepscaler":
        return float(module["deepscaler"].get_deepscaler_rule_based_reward(response, label))  # type: ignore[attr-defined]
    if kind == "f1":
        return float(module["f1"].f1_score(response, label)[0])  # type: ignore[attr-defined]
    return float(module["gpqa"].compute_gpqa_reward(response, label))  # type: ignore[attr-defined]


def test_the_recorded_slime_verdicts_are_slimes() -> None:
    hub = slime_rm_hub.load()
    if hub is None:
        pytest.skip("SLIME_SRC is not set to a slime checkout: slime's verdicts are checked as recorded")
    for label, response, _, slime in MATH_CASES:
        assert _slime_value(hub, "math", label, response) == slime, (label, response)
    for kind, label, response, value in SLIME_CASES:
        assert _slime_value(hub, kind, label, response) == pytest.approx(value, abs=1e-4), (kind, response)
