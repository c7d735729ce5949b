"""An environment server over HTTP: one JSON POST per environment step.

`POST url {"episode_id", "turn", "prompt", "label", "action", "group_index", "sample_index"}` is
answered by `{"observation": str | "observation_ids": [int], "done": bool, "reward": number?,
"info": object?}` (docs/episodes.md). Shaped like the remote reward (`rewards/remote.py`) and
bounded the same way, by the same client (`rewards/jsonpost.py`: bounded concurrency, timeouts,
retries with backoff, no redirects — they would send the episode to a host outside `--env-url`); a
reply read up to `MAX_REPLY_BYTES` and no further; `info` kept only up to `MAX_INFO_BYTES` of
JSON; a failure reason at most `MAX_FAILURE_CHARS` characters. One episode's failure is its
`EnvFailed`, never an exception.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from rollout_grpc.server.envs.api import (
    EnvFailed,
    EnvOutcome,
    EnvReply,
    EnvRequest,
    EnvUnavailable,
    EpisodeConfig,
)
from rollout_grpc.server.rewards.connections import PostConnections
from rollout_grpc.server.rewards.jsonpost import JsonPoster

#: Bytes of one reply read at most (an observation of 1 MiB is far beyond any context window).
MAX_REPLY_BYTES = 1 << 20
#: Bytes of JSON of a reply's `info` kept as the sample's reward detail.
MAX_INFO_BYTES = 16 << 10
#: Characters of a failure reason.
MAX_FAILURE_CHARS = 512


def read_reply(answer: object) -> EnvOutcome:
    """The decoded JSON of a reply -> EnvReply, or EnvFailed naming the field that is wrong."""
    if not isinstance(answer, Mapping):
        return EnvFailed(f"the reply is a JSON {type(answer).__name__}, not an object")
    done = answer.get("done")
    if not isinstance(done, bool):
        return EnvFailed("the reply's `done` must be true or false")
    observation = _observation(answer)
    if isinstance(observation, EnvFailed):
        return observation
    reward = answer.get("reward")
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
    ):
        return EnvFailed(f"the reply's `reward` must be a finite number or absent, got {reward!r}"[:200])
    info = answer.get("info")
    if info is not None and not isinstance(info, Mapping):
        return EnvFailed(f"the reply's `info` must be an object, got {type(info).__name__}")
    return EnvReply(
        observation=observation[0],
        observation_ids=observation[1],
        done=done,
        reward=None if reward is None else float(reward),
        info=_bounded_info(info),
    )


def _observation(answer: Mapping[str, object]) -> tuple[str, tuple[int, ...] | None] | EnvFailed:
    """(text, token ids or None): exactly one of `observation` and `observation_ids` (or neither)."""
    text = answer.get("observation") or ""
    if not isinstance(text, str):
        return EnvFailed(f"the reply's `observation` must be a string, got {type(text).__name__}")
    ids = answer.get("observation_ids")
    if ids is None:
        return text, None
    if text:
        return EnvFailed("the reply gives both `observation` and `observation_ids`; give one")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        return EnvFailed("the reply's `observation_ids` must be a list of non-negative integers")
    return "", tuple(ids)


def _bounded_info(info: Mapping[str, object] | None) -> dict[str, object] | None:
    """The reply's `info`, or a note when its JSON is over `MAX_INFO_BYTES`."""
    if info is None:
        return None
    size = len(json.dumps(info, default=str))
    if size > MAX_INFO_BYTES:
        return {"info_omitted": f"the environment's info was {size} bytes of JSON, over {MAX_INFO_BYTES}"}
    return dict(info)


class RemoteEnvironment:
    """An environment server over HTTP, one client session per step (over the replica's keep-alive
    pool when `connections` is given: rewards/connections.py)."""

    def __init__(self, config: EpisodeConfig, connections: PostConnections | None = None) -> None:
        self._config = config
        self._http = JsonPoster.of(
            config, what="environment", max_reply_bytes=MAX_REPLY_BYTES, connections=connections
        )

    async def probe(self) -> None:
        """Any HTTP answer but a redirect proves the URL reachable (the server may refuse GET)."""
        why = await self._http.probe()
        if why is not None:
            raise EnvUnavailable(f"environment {self._config.url}: {why}")

    async def step(self, request: EnvRequest) -> EnvOutcome:
        payload = {
            "episode_id": request.episode_id,
            "turn": request.turn,
            "prompt": request.prompt,
            "label": request.label,
            "action": request.action,
            "group_index": request.group_index,
            "sample_index": request.sample_index,
        }
        try:
            answer = await self._http.post(payload)
        except ValueError as exc:
            return EnvFailed(f"environment {self._config.url}: {exc}"[:MAX_FAILURE_CHARS])
        outcome = read_reply(answer)
        if isinstance(outcome, EnvFailed):
            return EnvFailed(f"environment {self._config.url}: {outcome.reason}"[:MAX_FAILURE_CHARS])
        return outcome

    async def close(self) -> None:
        await self._http.close()
