"""What the client tests share: a prompt and sampling params, and fake RolloutServices for what a
live replica will not do on demand (refuse a call once; never answer)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from rollout_grpc.client import pb

PROMPT = [1, 92, 510, 206]
SHORT = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 1.0, "max_new_tokens": 3000, "ignore_eos": True}

Ctx = grpc.aio.ServicerContext[Any, Any]
PUSHBACK_MS = 700  # well above the policy's 0.2 s initial backoff, so only the pushback explains it


class RefuseOnce:
    """A fake RolloutService that refuses the first call like a full replica, then serves."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.lock = threading.Lock()

    async def _refuse_first(self, context: Ctx) -> None:
        with self.lock:
            self.arrivals.append(time.monotonic())
            first = len(self.arrivals) == 1
        if first:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(PUSHBACK_MS)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "admission queue full")

    async def info(self, request: pb.GetServerInfoRequest, context: Ctx) -> object:
        await self._refuse_first(context)
        return pb.GetServerInfoResponse(in_flight=7)

    async def generate(self, request: pb.GenerateRequest, context: Ctx) -> AsyncIterator[pb.GenerateResponse]:
        await self._refuse_first(context)
        yield pb.GenerateResponse(sample=pb.Sample(tokens=list(request.sample.tokens), response_length=0))


class Silent:
    """A fake RolloutService whose Generate never answers until `release` is set.

    The one deterministic way to reach a caller's deadline: a live replica ends a generation with
    its ABORTED sample before the deadline (`--deadline-margin`), and even a deadline already
    expired at the call raced the replica's answer in the blocking client."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        self.release.wait()
        yield from ()
