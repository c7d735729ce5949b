"""The typed boundary between the rollout step and an environment server.

An episode alternates model turns and environment replies: after each model turn the step sends
the environment the turn's text (`EnvRequest`) and gets back an `EnvReply` (the next observation,
`done`, a reward) or an explicit `EnvFailed` with the reason. The step calls nothing else, so the
episode loop (`rollout/step/episodes.py`) stays free of HTTP; `remote.py` is the one transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

#: Most model turns one episode may ask for.
MAX_TURNS = 256
#: Most attempts after the first of one environment request.
MAX_RETRIES = 10
#: Most concurrent requests from one step to its environment server.
MAX_CONCURRENCY = 1024


@dataclass(frozen=True, slots=True)
class EpisodeConfig:
    """How a step's samples run as episodes (the proto's `EpisodeSpec`; checked by `check`)."""

    #: The environment server's URL (http or https), probed once at step start.
    url: str
    #: Model turns at most; an episode that reaches it without `done` ends ("max_turns").
    max_turns: int = 8
    #: Tokens one model turn may generate at most (0: only the step's whole budget applies).
    turn_max_new_tokens: int = 0
    #: Seconds per attempt.
    timeout_s: float = 30.0
    #: Attempts after the first, with exponential backoff (what can succeed on a second try).
    max_retries: int = 2
    #: Concurrent requests to the environment from one step.
    max_concurrency: int = 32
    #: First backoff (doubles per retry).
    backoff_s: float = 0.1


@dataclass(frozen=True, slots=True)
class EnvRequest:
    """One environment step: what the model said in turn `turn` (0-based) of an episode."""

    episode_id: str
    turn: int
    prompt: str
    label: str
    action: str
    group_index: int
    sample_index: int


@dataclass(frozen=True, slots=True)
class EnvReply:
    """The environment's answer: the next observation (text or token ids), `done`, a reward."""

    observation: str = ""
    #: Token ids to insert as they are (instead of tokenising `observation`).
    observation_ids: tuple[int, ...] | None = None
    done: bool = False
    reward: float | None = None
    #: The reply's `info` object (bounded), kept as the sample's reward detail.
    info: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class EnvFailed:
    """No usable answer for this step, and why (unreachable, timeout, HTTP error, malformed...)."""

    reason: str


EnvOutcome = EnvReply | EnvFailed


class EnvUnavailable(Exception):
    """The environment server cannot be reached at all (the start-of-step probe)."""


class Environment(Protocol):
    """An environment server for one step."""

    async def probe(self) -> None:
        """Raise `EnvUnavailable` when the server does not answer at all."""

    async def step(self, request: EnvRequest) -> EnvOutcome:
        """One environment step; never raises for one episode's failure."""

    async def close(self) -> None:
        """Release the step's connections."""
