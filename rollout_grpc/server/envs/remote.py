"""An environment server over HTTP: one JSON POST per environment step.

`POST url {"episode_id", "turn", "prompt", "label", "action", "group_index", "sample_index"}` is
answered by `{"observation": str | "observation_ids": [int], "done": bool, "reward": number?,
"info": object?}` (docs/episodes.md). Shaped like the remote reward (`rewards/remote.py`) and
bounded the same way, for the same reasons: requests bounded (`max_concurrency`), each attempt
timed out, connection failures, timeouts, 429 and 5xx retried with exponential backoff; a reply
read up to `MAX_REPLY_BYTES` and no further; redirects never followed (they would send the
episode to a host outside `--env-url`); `info` kept only up to `MAX_INFO_BYTES` of JSON; a failure
reason at most `MAX_FAILURE_CHARS` characters. One episode's failure is its `EnvFailed`, never an
exception.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping

import aiohttp

from rollout_grpc.server.envs.api import (
    EnvFailed,
    EnvOutcome,
    EnvReply,
    EnvRequest,
    EnvUnavailable,
    EpisodeConfig,
)
from rollout_grpc.server.rewards.remote import read_capped

#: Seconds the start-of-step probe may take.
PROBE_TIMEOUT_S = 5.0
#: Bytes of one reply read at most (an observation of 1 MiB is far beyond any context window).
MAX_REPLY_BYTES = 1 << 20
#: Bytes of a probe answer read at most.
MAX_PROBE_BYTES = 64 << 10
#: Bytes of JSON of a reply's `info` kept as the sample's reward detail.
MAX_INFO_BYTES = 16 << 10
#: Bytes of an error body quoted in a failure reason.
MAX_BODY_EXCERPT = 128
#: Characters of a failure reason.
MAX_FAILURE_CHARS = 512


class _Retryable(Exception):
    """An attempt failed in a way another attempt may not."""


def _excerpt(body: bytes) -> str:
    more = "..." if len(body) > MAX_BODY_EXCERPT else ""
    return f"{body[:MAX_BODY_EXCERPT]!r}{more}"


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


def _redirect(status: int) -> str | None:
    if 300 <= status < 400:
        return f"HTTP {status}: redirects are not followed (the environment URL must answer itself)"
    return None


class RemoteEnvironment:
    """An environment server over HTTP (aiohttp), one client session per step."""

    def __init__(self, config: EpisodeConfig) -> None:
        self._config = config
        self._limit = asyncio.Semaphore(config.max_concurrency)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # trust_env stays off: an environment on the cluster network is never reached through
            # a proxy configured for the outside world.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._config.timeout_s))
        return self._session

    async def probe(self) -> None:
        """Any HTTP answer proves the URL reachable (the server may refuse GET); a redirect does not."""
        try:
            async with self._http().get(
                self._config.url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S), allow_redirects=False
            ) as response:
                await read_capped(response, MAX_PROBE_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EnvUnavailable(f"environment {self._config.url} does not answer: {exc!r}") from exc
        redirect = _redirect(response.status)
        if redirect is not None:
            raise EnvUnavailable(f"environment {self._config.url}: {redirect}")

    async def _post(self, payload: Mapping[str, object]) -> object:
        """One POST with retries: the decoded JSON, or the failure as a ValueError."""
        config = self._config
        delay = config.backoff_s
        last = ""
        for attempt in range(config.max_retries + 1):
            if attempt:
                await asyncio.sleep(delay)  # backoff between attempts, not synchronisation
                delay *= 2
            try:
                async with (
                    self._limit,
                    self._http().post(config.url, json=payload, allow_redirects=False) as response,
                ):
                    redirect = _redirect(response.status)
                    if redirect is not None:
                        raise ValueError(redirect)
                    body = await read_capped(response, MAX_REPLY_BYTES)
                    if body is None:
                        raise ValueError(
                            f"HTTP {response.status}: the reply is over the {MAX_REPLY_BYTES} byte cap "
                            "(reading stopped there)"
                        )
                    if response.status == 429 or response.status >= 500:
                        raise _Retryable(f"HTTP {response.status}")
                    if response.status >= 400:
                        raise ValueError(f"HTTP {response.status}: {_excerpt(body)}")
                    try:
                        return json.loads(body)
                    except ValueError:
                        raise ValueError(f"the reply is not JSON: {_excerpt(body)}") from None
            except (_Retryable, aiohttp.ClientError, TimeoutError) as exc:
                last = str(exc) or type(exc).__name__
        raise ValueError(f"{last} after {config.max_retries + 1} attempts")

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
            answer = await self._post(payload)
        except ValueError as exc:
            return EnvFailed(f"environment {self._config.url}: {exc}"[:MAX_FAILURE_CHARS])
        outcome = read_reply(answer)
        if isinstance(outcome, EnvFailed):
            return EnvFailed(f"environment {self._config.url}: {outcome.reason}"[:MAX_FAILURE_CHARS])
        return outcome

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
