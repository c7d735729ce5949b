"""Rule-based rewards that need no server: math answer equivalence and exact match.

`MathReward` uses the `math-verify` library (HuggingFace): the label and the response are parsed
into sympy expressions (the response's last `\\boxed{}` or last expression wins) and compared for
equivalence, so `\\frac{1}{2}` and `0.5` agree where a string comparison would not. Parsing runs
in a worker thread (sympy can take long on adversarial input) with math-verify's own signal
timeouts off, since signals only work on the main thread.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence

from rollout_grpc.server.rewards.api import RewardFailed, RewardOutcome, RewardRequest, RewardResult
from rollout_grpc.server.rewards.graders import math_verify as graders_math_verify

_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def math_equal(label: str, response: str) -> bool:
    """True when the response's answer is mathematically equal to `label` (math-verify, both sides
    parsed with its LaTeX and expression configs: graders/math_verify.py)."""
    return graders_math_verify.math_equal(label, response)


def exact_answer(response: str) -> str:
    """The answer of a response for exact match: its last `\\boxed{...}`, else the stripped text."""
    boxed = _BOXED.findall(response)
    return (boxed[-1] if boxed else response).strip()


class _RuleReward:
    """Common shape: a pure function of (label, response) run per sample."""

    async def probe(self) -> None:
        return None

    def _value(self, request: RewardRequest) -> float:
        raise NotImplementedError

    async def score(self, request: RewardRequest) -> RewardOutcome:
        if not request.label:
            return RewardFailed("no label to compare the answer with (PromptGroup.label is empty)")
        try:
            return RewardResult(await asyncio.to_thread(self._value, request))
        except Exception as exc:  # a parser bug on odd input is one sample's failure
            return RewardFailed(f"could not check the answer: {exc!r}"[:300])

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardOutcome]:
        return list(await asyncio.gather(*(self.score(r) for r in requests)))

    async def close(self) -> None:
        return None


class MathReward(_RuleReward):
    """1.0 when the answer is equivalent to the label, else 0.0 (math-verify)."""

    def _value(self, request: RewardRequest) -> float:
        return 1.0 if math_equal(request.label, request.response) else 0.0


class ExactMatchReward(_RuleReward):
    """1.0 when the answer (last `\\boxed{}` or the stripped response) equals the stripped label."""

    def _value(self, request: RewardRequest) -> float:
        return 1.0 if exact_answer(request.response) == request.label.strip() else 0.0


class GradedReward(_RuleReward):
    """A rule kind whose grader is a pure `(label, response) -> float` function (graders/):
    slime's rm_hub kinds (registry.py names them). `detail`, when given, is the whole answer slime's
    function returns (dapo's `{score, acc, pred}`), kept as the sample's reward detail."""

    def __init__(
        self, rule: Callable[[str, str], float], detail: Callable[[str, str], dict[str, object]] | None = None
    ) -> None:
        self.rule = rule
        self.detail = detail

    async def score(self, request: RewardRequest) -> RewardOutcome:
        outcome = await super().score(request)
        if self.detail is None or not isinstance(outcome, RewardResult):
            return outcome
        try:
            detail = await asyncio.to_thread(self.detail, request.label, request.response)
        except Exception as exc:
            return RewardFailed(f"could not check the answer: {exc!r}"[:300])
        return RewardResult(outcome.value, detail)

    def _value(self, request: RewardRequest) -> float:
        return self.rule(request.label, request.response)
