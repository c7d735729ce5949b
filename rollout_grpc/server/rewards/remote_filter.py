"""A custom dynamic filter as a remote HTTP callable, under the reward server's bounds.

`POST url {"group_index", "prompt", "label", "responses", "rewards", "statuses"}` answered by
`{"keep": bool, "reason": str}` or a bare boolean. The call goes through `RemoteReward`'s bounded
POST (reply cap, no redirects, a timeout per attempt, retries with backoff on connection failures,
timeouts, 429 and 5xx), so a filter server can do no more to the replica than a reward server.
A filter that cannot answer (down, slow past its retries, malformed) raises `FilterFailed`: the
group fails with the reason and the step stops (runner.py), never a silent keep or drop.
"""

from __future__ import annotations

import dataclasses
import math
from urllib.parse import urlsplit

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.rewards.api import (
    FilterFailed,
    FilterGroup,
    FilterVerdict,
    RemoteFilterConfig,
    RewardConfig,
    RewardKind,
)
from rollout_grpc.server.rewards.connections import PostConnections
from rollout_grpc.server.rewards.remote import MAX_FAILURE_CHARS, RemoteReward

#: Characters of a remote filter's drop reason kept (the rest is cut, marked).
MAX_REASON_CHARS = 512
#: Concurrent requests to one remote filter from one step (groups end one by one: few at once).
MAX_CONCURRENCY = 16


def read_verdict(answer: object) -> FilterVerdict:
    """The verdict in a filter's answer; FilterFailed naming what is wrong with a malformed one."""
    if isinstance(answer, bool):
        return None if answer else "the remote filter dropped the group"
    if isinstance(answer, dict) and isinstance(answer.get("keep"), bool):
        if answer["keep"]:
            return None
        reason = answer.get("reason", "")
        if not isinstance(reason, str):
            raise FilterFailed(f"the answer's 'reason' must be a string, got {type(reason).__name__}")
        reason = reason or "the remote filter dropped the group"
        return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS] + "..."
    shape = type(answer).__name__
    raise FilterFailed(f"the answer must be a boolean or an object with a boolean 'keep', got a {shape}")


class RemoteFilter:
    """One step's remote filter (one HTTP session, closed with the step; over the replica's
    keep-alive pool when `connections` is given)."""

    def __init__(self, config: RemoteFilterConfig, connections: PostConnections | None = None) -> None:
        self._url = config.url
        self._http = RemoteReward(
            RewardConfig(
                kind=RewardKind.REMOTE,
                url=config.url,
                timeout_s=config.timeout_s,
                max_retries=config.max_retries,
                max_concurrency=MAX_CONCURRENCY,
                backoff_s=config.backoff_s,
            ),
            connections,
        )

    async def probe(self) -> None:
        """RewardUnavailable when the URL does not answer (checked once at step start)."""
        await self._http.probe()

    async def verdict(self, group: FilterGroup) -> FilterVerdict:
        try:
            answer = await self._http.post(dataclasses.asdict(group))
        except ValueError as exc:
            raise FilterFailed(f"filter {self._url}: {exc}"[:MAX_FAILURE_CHARS]) from None
        try:
            return read_verdict(answer)
        except FilterFailed as exc:
            raise FilterFailed(f"filter {self._url}: {exc}"[:MAX_FAILURE_CHARS]) from None

    async def close(self) -> None:
        await self._http.close()


def build(config: RemoteFilterConfig, connections: PostConnections | None = None) -> RemoteFilter:
    """The remote filter of `config`; INVALID_ARGUMENT naming a bad field."""
    parts = urlsplit(config.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidArgument("filter.url", f"must be an http(s) URL for a REMOTE filter; got {config.url!r}")
    if not math.isfinite(config.timeout_s) or config.timeout_s <= 0:
        raise InvalidArgument("filter.timeout_s", f"must be a positive finite number, got {config.timeout_s}")
    if config.max_retries < 0:
        raise InvalidArgument("filter.max_retries", f"must be non-negative, got {config.max_retries}")
    return RemoteFilter(config, connections)
