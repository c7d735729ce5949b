"""The typed boundary between the rollout step and a reward model.

A reward model answers a `RewardRequest` with a `RewardResult` or an explicit `RewardFailed`
(reason, never a silent 0). It may score one sample (`score`) or a whole group in one call
(`score_group`, slime's `--group-rm`). The step calls nothing else, so a new kind is a new module
plus one entry in `registry.py`; nothing here knows HTTP.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class RewardKind(enum.Enum):
    """The reward kinds a step may ask for (the proto's `RewardKind`)."""

    NONE = "none"
    REMOTE = "remote"
    MATH = "math"
    EXACT_MATCH = "exact_match"
    #: slime's rm_hub kinds (rewards/graders/slime_hub.py).
    SLIME_MATH = "slime_math"
    DAPO = "dapo"
    DEEPSCALER = "deepscaler"
    F1 = "f1"
    GPQA = "gpqa"
    #: An operator-installed plugin named by `RewardConfig.plugin` (rollout/step/plugins.py).
    PLUGIN = "plugin"


@dataclass(frozen=True, slots=True)
class RewardConfig:
    """How to build a reward model for one step (validated by `registry.build`)."""

    kind: RewardKind = RewardKind.NONE
    #: REMOTE: the reward model's URL.
    url: str = ""
    #: REMOTE: the key of the reward in a JSON-object answer.
    reward_key: str = "reward"
    #: REMOTE: seconds per attempt.
    timeout_s: float = 30.0
    #: REMOTE: attempts after the first, with exponential backoff.
    max_retries: int = 2
    #: REMOTE: concurrent requests from one step.
    max_concurrency: int = 32
    #: REMOTE: first backoff (doubles per retry).
    backoff_s: float = 0.1
    #: REMOTE, GROUP scope: one batch POST per group instead of slime's one POST per sample.
    batch_group: bool = False
    #: PLUGIN: the entry point name of the reward plugin.
    plugin: str = ""


@dataclass(frozen=True, slots=True)
class RewardRequest:
    """What a reward model sees of one sample (slime's remote_rm payload)."""

    prompt: str
    response: str
    label: str = ""
    metadata: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A reward; `detail` is the whole answer when the model returned a JSON object."""

    value: float
    detail: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class RewardFailed:
    """No reward for this sample, and why (timeout, HTTP error, not a number, ...)."""

    reason: str


RewardOutcome = RewardResult | RewardFailed


class RewardUnavailable(Exception):
    """The reward model cannot be used at all (its probe failed): the step refuses to start."""


class RewardModel(Protocol):
    """A reward model of any kind."""

    async def probe(self) -> None:
        """Raise `RewardUnavailable` when the model cannot be reached (checked at step start)."""

    async def score(self, request: RewardRequest) -> RewardOutcome:
        """The reward of one sample. Never raises for a per-sample failure: returns RewardFailed."""

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardOutcome]:
        """The rewards of a whole group (one entry per request, same order), in one call."""

    async def close(self) -> None:
        """Release connections (end of the step)."""


@dataclass(frozen=True, slots=True)
class FilterGroup:
    """What a custom filter (plugin or remote) sees of a finished, scored group."""

    group_index: int
    prompt: str
    label: str
    responses: list[str]
    #: Per sample, its reward (None: unscored).
    rewards: list[float | None]
    #: Per sample, its status name in lower case ("completed", "truncated", ...).
    statuses: list[str]


#: A custom filter's verdict: None to keep the group, else why it is dropped.
FilterVerdict = str | None


class FilterFailed(Exception):
    """A custom filter could not decide (raised, down, slow, malformed): the group fails."""


@dataclass(frozen=True, slots=True)
class RemoteFilterConfig:
    """A remote filter: its URL and the reward server's bounds (rewards/remote_filter.py)."""

    url: str
    timeout_s: float = 30.0
    max_retries: int = 2
    backoff_s: float = 0.1


class GroupFilter(Protocol):
    """A custom dynamic filter over a finished group."""

    async def verdict(self, group: FilterGroup) -> FilterVerdict:
        """None to keep the group, else the reason it is dropped; FilterFailed when it cannot tell."""
        ...

    async def close(self) -> None:
        """Release what the filter holds (an HTTP session)."""
        ...
