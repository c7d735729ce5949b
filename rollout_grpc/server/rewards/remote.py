"""An HTTP reward model in slime's remote_rm shape.

One sample: `POST url {"prompt", "response", "label"}` answered by a number, or by a JSON object
whose `reward_key` holds the number (the whole object becomes the sample's reward detail). A group
(`--group-rm`) is scored as slime does it, one such POST per sample; with `batch_group`, one
`POST url {"prompts", "responses", "labels"}` answered by a list of those, one per sample.
Requests are bounded (`max_concurrency`), each attempt has a timeout, and what can succeed on a
second try (connection failures, timeouts, 429 and 5xx) is retried with exponential
backoff; anything else is the sample's `RewardFailed` with the reason. Nothing here raises for
one sample's failure.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence

import aiohttp

from rollout_grpc.server.rewards.api import (
    RewardConfig,
    RewardFailed,
    RewardOutcome,
    RewardRequest,
    RewardResult,
    RewardUnavailable,
)

#: Seconds the start-of-step probe may take.
PROBE_TIMEOUT_S = 5.0


class _Retryable(Exception):
    """An attempt failed in a way another attempt may not."""


def read_reward(answer: object, key: str) -> RewardOutcome:
    """A number, or a JSON object with `key` -> RewardResult; anything else -> RewardFailed."""
    if isinstance(answer, bool):
        return RewardFailed(f"the reward model answered a boolean ({answer}), not a number")
    if isinstance(answer, int | float):
        if not math.isfinite(answer):
            return RewardFailed(f"the reward model answered {answer}, not a finite number")
        return RewardResult(float(answer))
    if isinstance(answer, Mapping):
        value = answer.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return RewardFailed(f"the reward model's answer has no finite number under {key!r}")
        return RewardResult(float(value), dict(answer))
    return RewardFailed(f"the reward model answered {type(answer).__name__}, not a number or an object")


class RemoteReward:
    """A remote reward model over HTTP (aiohttp), one session per step."""

    def __init__(self, config: RewardConfig) -> None:
        self._config = config
        self._limit = asyncio.Semaphore(config.max_concurrency)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # trust_env stays off: a reward model on the cluster network is never reached through
            # a proxy configured for the outside world.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._config.timeout_s))
        return self._session

    async def probe(self) -> None:
        """Any HTTP answer proves the URL reachable (a remote_rm server may refuse GET)."""
        try:
            async with self._http().get(
                self._config.url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RewardUnavailable(f"reward model {self._config.url} does not answer: {exc!r}") from exc

    async def _post(self, payload: Mapping[str, object]) -> object:
        """One POST with retries; the decoded JSON answer, or RewardFailed's reason as an exception."""
        config = self._config
        delay = config.backoff_s
        last = ""
        for attempt in range(config.max_retries + 1):
            if attempt:
                await asyncio.sleep(delay)  # backoff between attempts, not synchronisation
                delay *= 2
            try:
                async with self._limit, self._http().post(config.url, json=payload) as response:
                    body = await response.read()
                    if response.status == 429 or response.status >= 500:
                        raise _Retryable(f"HTTP {response.status}")
                    if response.status >= 400:
                        raise ValueError(f"HTTP {response.status}: {body[:200]!r}")
                    try:
                        return json.loads(body)
                    except ValueError:
                        raise ValueError(f"the answer is not JSON: {body[:200]!r}") from None
            except (_Retryable, aiohttp.ClientError, TimeoutError) as exc:
                last = str(exc) or type(exc).__name__
        raise ValueError(f"{last} after {config.max_retries + 1} attempts")

    async def score(self, request: RewardRequest) -> RewardOutcome:
        payload = {"prompt": request.prompt, "response": request.response, "label": request.label}
        try:
            answer = await self._post(payload)
        except ValueError as exc:
            return RewardFailed(f"reward model {self._config.url}: {exc}")
        return read_reward(answer, self._config.reward_key)

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardOutcome]:
        if not self._config.batch_group:  # slime's group RM: one remote_rm request per sample
            return list(await asyncio.gather(*(self.score(r) for r in requests)))
        payload = {
            "prompts": [r.prompt for r in requests],
            "responses": [r.response for r in requests],
            "labels": [r.label for r in requests],
        }
        try:
            answer = await self._post(payload)
        except ValueError as exc:
            return [RewardFailed(f"reward model {self._config.url}: {exc}")] * len(requests)
        if not isinstance(answer, list) or len(answer) != len(requests):
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            return [
                RewardFailed(f"a group reward must be a list of {len(requests)} rewards, got {got}")
            ] * len(requests)
        return [read_reward(item, self._config.reward_key) for item in answer]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
