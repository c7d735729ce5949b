"""`FleetBus` over Redis pub/sub: every process of the fleet that reaches one Redis, asked at once.

Every process subscribes to two channels: `rollout:fanout:ask` (the questions, to everyone) and
`rollout:fanout:reply:<token>` (its own answers; `token` is random per process). A question is a
JSON object `{"id", "reply", "body"}` published on the ask channel; `PUBLISH` returns how many
subscribers received it, the asker included (it is subscribed too and acknowledges its own
question without running the handler), so the asker waits for exactly that many answers, or the
timeout. Each receiver runs the handler in a task of its own (an abort of an owner waits until its
generations ended) and publishes `{"id", "body"}` on the asker's reply channel.

Pub/sub is fire-and-forget: a process that is reconnecting when a question is published does not
receive it and is not counted. Its generations are then missed, and the ids it held are reported
unknown, never claimed aborted (the caller may abort again). The subscriber reconnects by itself
after a Redis outage and subscribes again (redis-py's PubSub re-subscribes on connect).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from rollout_grpc.server.state.api import StoreUnavailable
from rollout_grpc.server.state.bus import Handler
from rollout_grpc.server.state.redis_store import redis_call

log = structlog.get_logger(__name__)

#: The channel every process subscribes to for questions.
ASK_CHANNEL = "rollout:fanout:ask"
#: The prefix of each process's answer channel.
REPLY_PREFIX = "rollout:fanout:reply:"
#: How long one read of the subscription waits before it checks for shutdown.
_READ_S = 1.0
#: Bounds of the wait between reconnection attempts after the store stopped answering.
_RETRY_MIN_S = 0.1
_RETRY_MAX_S = 2.0


class _Question:
    """One outstanding `ask_all`: the answers so far, and the count that completes it."""

    def __init__(self) -> None:
        self.expected: int | None = None
        self.acknowledged = 0
        self.answers: list[dict[str, Any]] = []
        self.complete = asyncio.Event()

    def check(self) -> None:
        if self.expected is not None and self.acknowledged + len(self.answers) >= self.expected:
            self.complete.set()


class RedisBus:
    """The fleet bus over one Redis (the state store's connection pool)."""

    def __init__(self, client: aioredis.Redis, name: str) -> None:
        self.name = name
        self._client = client
        self._token = secrets.token_hex(8)
        self._reply = REPLY_PREFIX + self._token
        self._pubsub = client.pubsub()
        self._handler: Handler | None = None
        self._reader: asyncio.Task[None] | None = None
        self._questions: dict[str, _Question] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self, handler: Handler) -> None:
        """Subscribe (StoreUnavailable when the store does not answer), then read in the background."""
        self._handler = handler
        try:
            await self._pubsub.subscribe(ASK_CHANNEL, self._reply)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(self.name, f"cannot subscribe to the fleet bus ({exc})") from exc
        self._reader = asyncio.create_task(self._read())

    async def ask_all(self, message: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        qid = secrets.token_hex(8)
        question = self._questions[qid] = _Question()
        payload = json.dumps({"id": qid, "reply": self._reply, "body": message})
        try:
            delivered = int(await redis_call(self.name, lambda: self._client.publish(ASK_CHANNEL, payload)))
            question.expected = delivered
            question.check()
            try:
                await asyncio.wait_for(question.complete.wait(), max(0.0, timeout_s))
            except TimeoutError:
                missing = delivered - question.acknowledged - len(question.answers)
                log.warning(
                    "fleet_bus_answers_missing", store=self.name, missing=missing, timeout_s=timeout_s
                )
            return list(question.answers)
        finally:
            del self._questions[qid]

    async def _read(self) -> None:
        """Read the subscription until `close()`, reconnecting after an outage."""
        backoff_s = _RETRY_MIN_S
        while not self._closing:
            try:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=_READ_S)
            except (RedisError, OSError) as exc:
                if self._closing:
                    return
                log.warning("fleet_bus_disconnected", store=self.name, error=str(exc), retry_s=backoff_s)
                await asyncio.sleep(backoff_s)  # a reconnection backoff, not a synchronisation
                backoff_s = min(2 * backoff_s, _RETRY_MAX_S)
                continue
            backoff_s = _RETRY_MIN_S
            if message is not None and message.get("type") == "message":
                self._dispatch(message["channel"], message["data"])

    def _dispatch(self, channel: bytes | str, data: bytes | str) -> None:
        try:
            decoded = json.loads(data)
            qid = str(decoded["id"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("fleet_bus_bad_message", store=self.name, error=str(exc))
            return
        name = channel.decode() if isinstance(channel, bytes) else channel
        if name == self._reply:
            question = self._questions.get(qid)
            if question is not None and isinstance(decoded.get("body"), dict):
                question.answers.append(decoded["body"])
                question.check()
            return
        if decoded.get("reply") == self._reply:  # our own question: delivered here, nothing to do
            question = self._questions.get(qid)
            if question is not None:
                question.acknowledged += 1
                question.check()
            return
        task = asyncio.create_task(self._answer(qid, str(decoded.get("reply", "")), decoded.get("body")))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, qid: str, reply: str, body: Any) -> None:
        if self._handler is None or not reply.startswith(REPLY_PREFIX) or not isinstance(body, dict):
            log.warning("fleet_bus_bad_message", store=self.name, error="no reply channel or body")
            return
        try:
            answer = await self._handler(body)
        except Exception as exc:  # answered all the same, so that the asker need not wait it out
            log.warning("fleet_bus_handler_failed", store=self.name, error=repr(exc))
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            await self._client.publish(reply, json.dumps({"id": qid, "body": answer}))
        except (RedisError, OSError) as exc:
            log.warning("fleet_bus_answer_failed", store=self.name, error=str(exc))

    async def close(self) -> None:
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self._pubsub.aclose()
        except (RedisError, OSError) as exc:
            log.warning("fleet_bus_close_failed", store=self.name, error=str(exc))
