"""An HTTP reward model in slime's remote_rm shape.

One sample: `POST url {"prompt", "response", "label"}` answered by a number, or by a JSON object
whose `reward_key` holds the number (the whole object becomes the sample's reward detail). A group
(`--group-rm`) is scored as slime does it, one such POST per sample; with `batch_group`, one
`POST url {"prompts", "responses", "labels"}` answered by a list of those, one per sample.
The HTTP calls are `jsonpost.JsonPoster`'s (bounded concurrency, timeouts, retries with backoff,
no redirects: a redirect would send the prompt, response and label to a host outside
`--reward-url`); a reply is read up to `MAX_REPLY_BYTES` and no further (a 512 MiB answer took a
worker to 1.7 GB). A failure that retrying cannot mend is the sample's `RewardFailed` with the
reason; nothing here raises for one sample's failure. What goes back to the caller is bounded too
(docs/security.md "Reward servers"): a reward's detail up to `MAX_DETAIL_BYTES` of JSON, a failure
reason up to `MAX_FAILURE_CHARS` characters.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence

from rollout_grpc.server.rewards.api import (
    RewardConfig,
    RewardFailed,
    RewardOutcome,
    RewardRequest,
    RewardResult,
    RewardUnavailable,
)
from rollout_grpc.server.rewards.connections import PostConnections
from rollout_grpc.server.rewards.jsonpost import JsonPoster

#: Bytes of one reward reply (one sample's, or a whole group's) read at most; over it the
#: sample's (or the group's) reward fails naming the cap. 1 MiB is 16 KiB per sample of a 64-group.
MAX_REPLY_BYTES = 1 << 20
#: Bytes of JSON of one reward detail returned to the caller as `Sample.reward_detail`.
MAX_DETAIL_BYTES = 16 << 10
#: Characters of a `reward_failure` reason.
MAX_FAILURE_CHARS = 512


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


class RemoteReward:
    """A remote reward model over HTTP (aiohttp), one session per step (over the replica's
    keep-alive pool when `connections` is given: connections.py)."""

    def __init__(self, config: RewardConfig, connections: PostConnections | None = None) -> None:
        self._config = config
        self._http = JsonPoster.of(
            config, what="reward", max_reply_bytes=MAX_REPLY_BYTES, connections=connections
        )

    async def probe(self) -> None:
        """Any HTTP answer but a redirect proves the URL reachable (a remote_rm server may refuse GET)."""
        why = await self._http.probe()
        if why is not None:
            raise RewardUnavailable(f"reward model {self._config.url}: {why}")

    async def post(self, payload: Mapping[str, object]) -> object:
        """One bounded POST of any JSON payload (the remote filter's call, rewards/remote_filter.py):
        the decoded answer, or ValueError with the reason after the retries."""
        return await self._http.post(payload)

    async def score(self, request: RewardRequest) -> RewardOutcome:
        payload = {"prompt": request.prompt, "response": request.response, "label": request.label}
        try:
            answer = await self._http.post(payload)
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
            answer = await self._http.post(payload)
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
        await self._http.close()
