"""Rule-based rewards that need no server: math answer equivalence and exact match.

`MathReward` uses the `math-verify` library (HuggingFace): the label and the response are parsed
into sympy expressions (the response's last `\\boxed{}` or last expression wins) and compared for
equivalence, so `\\frac{1}{2}` and `0.5` agree where a string comparison would not.

Both rules run on strings a caller chose, so both run in a child process with a time and a memory
limit (`processes.RuleProcesses`): a label such as `9^{9^{9^{9}}}` makes sympy compute a huge
power inside one C call that holds Python's lock, which froze the whole replica when it ran in a
thread. math-verify's own signal timeouts stay off (the child's limit is the one that holds).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence

from rollout_grpc.server.rewards.api import RewardFailed, RewardOutcome, RewardRequest, RewardResult
from rollout_grpc.server.rewards.graders import math_verify as graders_math_verify
from rollout_grpc.server.rewards.processes import Rule, RuleProcesses

_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def math_equal(label: str, response: str) -> bool:
    """True when the response's answer is mathematically equal to `label` (math-verify, both sides
    parsed with its LaTeX and expression configs: graders/math_verify.py)."""
    return graders_math_verify.math_equal(label, response)


def exact_answer(response: str) -> str:
    """The answer of a response for exact match: its last `\\boxed{...}`, else the stripped text."""
    boxed = _BOXED.findall(response)
    return (boxed[-1] if boxed else response).strip()


def math_value(label: str, response: str) -> float:
    """1.0 when the response's answer equals `label` mathematically, else 0.0 (runs in a child)."""
    return 1.0 if math_equal(label, response) else 0.0


def exact_value(label: str, response: str) -> float:
    """1.0 when the response's answer is the stripped label, else 0.0 (runs in a child)."""
    return 1.0 if exact_answer(response) == label.strip() else 0.0


class _RuleReward:
    """Common shape: a pure function of (label, response) run per sample in a bounded child."""

    rule: Rule

    def __init__(self, processes: RuleProcesses) -> None:
        self._processes = processes

    async def probe(self) -> None:
        return None

    async def score(self, request: RewardRequest) -> RewardOutcome:
        if not request.label:
            return RewardFailed("no label to compare the answer with (PromptGroup.label is empty)")
        return await self._processes.run(self.rule, request.label, request.response)

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardOutcome]:
        return list(await asyncio.gather(*(self.score(r) for r in requests)))

    async def close(self) -> None:
        return None


class MathReward(_RuleReward):
    """1.0 when the answer is equivalent to the label, else 0.0 (math-verify)."""

    rule = staticmethod(math_value)


class ExactMatchReward(_RuleReward):
    """1.0 when the answer (last `\\boxed{}` or the stripped response) equals the stripped label."""

    rule = staticmethod(exact_value)


class GradedReward(_RuleReward):
    """A rule kind whose grader is a pure, module-level `(label, response) -> float` function
    (graders/): slime's rm_hub kinds (registry.py names them), run in the bounded child processes
    like every rule. `detail`, when given, is the whole answer slime's function returns (dapo's
    `{score, acc, pred}`), kept as the sample's reward detail; it is a cheap regex over the
    response, so it runs in a thread once the bounded grader has answered."""

    def __init__(
        self,
        processes: RuleProcesses,
        rule: Rule,
        detail: Callable[[str, str], dict[str, object]] | None = None,
    ) -> None:
        super().__init__(processes)
        self.rule = rule
        self.detail = detail

    async def score(self, request: RewardRequest) -> RewardOutcome:
        outcome = await super().score(request)
        if self.detail is None or not isinstance(outcome, RewardResult):
            return outcome
        try:
            detail = await asyncio.to_thread(self.detail, request.label, request.response)
        except Exception as exc:  # a grader bug on odd input is one sample's failure
            return RewardFailed(f"could not check the answer: {exc!r}"[:300])
        return RewardResult(outcome.value, detail)
