"""An HTTP reward model in slime's remote_rm shape.

One sample: `POST url {"prompt", "response", "label"}` answered by a number, or by a JSON object
whose `reward_key` holds the number (the whole object becomes the sample's reward detail). A group
(`--group-rm`) is scored as slime does it, one such POST per sample; with `batch_group`, one
`POST url {"prompts", "responses", "labels"}` answered by a list of those, one per sample.
Requests are bounded (`max_concurrency`), each attempt has a timeout, and what can succeed on a
second try (connection failures, timeouts, 429 and 5xx) is retried with exponential
backoff; anything else is the sample's `RewardFailed` with the reason. Nothing here raises for
one sample's failure.

What a reward server can do to the replica and its caller is bounded (docs/security.md "Reward
servers"): a reply is read up to `MAX_REPLY_BYTES` and no further (a 512 MiB answer took a worker
to 1.7 GB), a probe answer up to `MAX_PROBE_BYTES`; redirects are never followed (a redirect would
send the prompt, response and label to a host outside `--reward-url`); a reward's detail goes back
to the caller only up to `MAX_DETAIL_BYTES` of JSON, and a failure reason (which quotes at most
`MAX_BODY_EXCERPT` bytes of an error body) is at most `MAX_FAILURE_CHARS` characters.
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
#: Bytes of one reward reply (one sample's, or a whole group's) read at most; over it the
#: sample's (or the group's) reward fails naming the cap. 1 MiB is 16 KiB per sample of a 64-group.
MAX_REPLY_BYTES = 1 << 20
#: Bytes of a probe answer read at most (any answer proves the URL reachable; the rest is unread).
MAX_PROBE_BYTES = 64 << 10
#: Bytes of JSON of one reward detail returned to the caller as `Sample.reward_detail`.
MAX_DETAIL_BYTES = 16 << 10
#: Bytes of an error answer's body quoted in a failure reason.
MAX_BODY_EXCERPT = 128
#: Characters of a `reward_failure` reason.
MAX_FAILURE_CHARS = 512


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
        return RewardResult(float(value), _bounded_detail(answer, key, float(value)))
    return RewardFailed(f"the reward model answered {type(answer).__name__}, not a number or an object")


def _bounded_detail(answer: Mapping[str, object], key: str, value: float) -> dict[str, object]:
    """The answer as the sample's detail, or the reward and a note when its JSON is over
    `MAX_DETAIL_BYTES` (the reward stands; only the detail is left out, and the caller is told)."""
    size = len(json.dumps(answer, default=str))
    if size <= MAX_DETAIL_BYTES:
        return dict(answer)
    note = f"the reward server's answer was {size} bytes of JSON, over the {MAX_DETAIL_BYTES} byte bound"
    return {key: value, "detail_omitted": note}


def _excerpt(body: bytes) -> str:
    """The start of an error body for a failure reason (bounded, escaped)."""
    more = "..." if len(body) > MAX_BODY_EXCERPT else ""
    return f"{body[:MAX_BODY_EXCERPT]!r}{more}"


async def read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The body, or None once it is over `cap` bytes (reading stops there; the connection is
    closed rather than drained)."""
    if response.content_length is not None and response.content_length > cap:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 << 10):
        body += chunk
        if len(body) > cap:
            return None
    return bytes(body)


def _redirect(status: int) -> str | None:
    if 300 <= status < 400:
        return f"HTTP {status}: redirects are not followed (the reward URL must answer itself)"
    return None


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
                self._config.url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S), allow_redirects=False
            ) as response:
                await read_capped(response, MAX_PROBE_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RewardUnavailable(f"reward model {self._config.url} does not answer: {exc!r}") from exc
        redirect = _redirect(response.status)
        if redirect is not None:
            raise RewardUnavailable(f"reward model {self._config.url}: {redirect}")

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
                            f"HTTP {response.status}: the answer is over the {MAX_REPLY_BYTES} byte cap "
                            "(reading stopped there)"
                        )
                    if response.status == 429 or response.status >= 500:
                        raise _Retryable(f"HTTP {response.status}")
                    if response.status >= 400:
                        raise ValueError(f"HTTP {response.status}: {_excerpt(body)}")
                    try:
                        return json.loads(body)
                    except ValueError:
                        raise ValueError(f"the answer is not JSON: {_excerpt(body)}") from None
            except (_Retryable, aiohttp.ClientError, TimeoutError) as exc:
                last = str(exc) or type(exc).__name__
        raise ValueError(f"{last} after {config.max_retries + 1} attempts")

    async def post(self, payload: Mapping[str, object]) -> object:
        """One bounded POST of any JSON payload (the remote filter's call, rewards/remote_filter.py):
        the decoded answer, or ValueError with the reason after the retries."""
        return await self._post(payload)

    async def score(self, request: RewardRequest) -> RewardOutcome:
        payload = {"prompt": request.prompt, "response": request.response, "label": request.label}
        try:
            answer = await self._post(payload)
        except ValueError as exc:
            return RewardFailed(f"reward model {self._config.url}: {exc}"[:MAX_FAILURE_CHARS])
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
            return [RewardFailed(f"reward model {self._config.url}: {exc}"[:MAX_FAILURE_CHARS])] * len(
                requests
            )
        if not isinstance(answer, list) or len(answer) != len(requests):
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            return [
                RewardFailed(f"a group reward must be a list of {len(requests)} rewards, got {got}")
            ] * len(requests)
        return [read_reward(item, self._config.reward_key) for item in answer]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
