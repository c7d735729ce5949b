"""Where one episode of a step is (kept on its `StepSample`, so a stopped episode continues
exactly; the loop itself is `episodes.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: How an episode ended (`EpisodeState.ended`, also `reward_detail["episode_end"]`).
DONE = "done"
MAX_TURNS = "max_turns"
BUDGET = "budget"
ENVIRONMENT = "environment_failed"
GENERATION = "generation_failed"


@dataclass(slots=True)
class EpisodeState:
    """Where an episode is; kept on its `StepSample` so a stopped episode continues exactly."""

    #: The episode's id for the environment (the request id of its first step: stable when a later
    #: step continues it).
    episode_id: str = ""
    #: Environment replies received (= model turns the environment has answered).
    turns: int = 0
    #: Where the current model turn's text starts in `Sample.response`.
    action_start: int = 0
    #: "" while running; else how it ended (DONE, MAX_TURNS, BUDGET, ENVIRONMENT, GENERATION).
    ended: str = ""
    #: Why, in words (the sample's `failure_reason` when it did not end with `done`).
    why: str = ""
    #: The last reward the environment sent (the episode's reward), and its last `info`.
    reward: float | None = None
    info: dict[str, object] | None = None
    #: Tokens the environment inserted (loss mask 0).
    env_tokens: int = 0
    #: Per model turn, its response positions [start, end) (for the caller's reading).
    turn_spans: list[tuple[int, int]] = field(default_factory=list)

    def detail(self) -> dict[str, object]:
        """The episode as the sample's reward detail."""
        out: dict[str, object] = {
            "episode_end": self.ended or "running",
            "turns": len(self.turn_spans),
            "env_replies": self.turns,
            "env_tokens": self.env_tokens,
        }
        if self.why:
            out["why"] = self.why
        if self.info is not None:
            out["info"] = self.info
        return out
