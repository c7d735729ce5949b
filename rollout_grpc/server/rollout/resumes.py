"""Resuming engines after a pause: within the caller's deadline, or later in the background.

A paused vLLM holds every new request, so an engine whose pause or resume did not answer in time
must not stay paused: `Resumes` keeps resuming it in the background until it answers, and stops
as soon as a caller pauses the engines on purpose (every Pause bumps `epoch`, here and, through
the fanout, on the sibling workers) or at shutdown (`close`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

from rollout_grpc.server.engines.api import ControlAction, EngineError, EngineRejected
from rollout_grpc.server.engines.pool import EngineHandle
from rollout_grpc.server.rollout.engine_fanout import StepFailed

log = structlog.get_logger(__name__)

#: How long after a late resume the engine is asked again whether a late pause paused it.
LATE_PAUSE_SETTLE_S = 1.0
#: Upper bound of the wait between late resumes of an engine that does not answer.
LATE_RESUME_MAX_BACKOFF_S = 5.0


class Resumes:
    """Resumes with bounded retries, and the background resumes of engines that did not answer."""

    def __init__(self, attempts: int = 3) -> None:
        self._attempts = attempts
        self._background: set[asyncio.Task[None]] = set()
        #: Bumped by every Pause: a late resume started before it must not undo it.
        self.epoch = 0

    def paused_on_purpose(self) -> None:
        """A Pause ran (here or on a sibling): late resumes started before it stop."""
        self.epoch += 1

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background task, kept referenced and cancelled by `close()`."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Cancel background work (at shutdown, before the HTTP session closes)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def resume_one(self, engine: EngineHandle) -> None:
        """POST /resume with bounded retries (the caller's deadline bounds them in time)."""
        for attempt in range(1, self._attempts + 1):
            try:
                await engine.client.resume()
                return
            except EngineError as exc:
                if attempt == self._attempts:
                    raise StepFailed(ControlAction.RESUME, exc) from exc
                await asyncio.sleep(0.05 * 2**attempt)  # retry backoff

    async def now_or_later(self, engine: EngineHandle) -> None:
        """Resume within the caller's deadline; if the deadline cancels it, keep trying in the
        background (a paused vLLM holds every new request)."""
        try:
            await self.resume_one(engine)
        except asyncio.CancelledError:
            self.spawn(self.later(engine))
            raise

    async def later(self, engine: EngineHandle) -> None:
        """Resume, in the background, an engine whose pause or resume did not answer in time.

        A hung engine still runs the unanswered pause when it wakes up (the request waits in its
        socket buffer), possibly after this resume, and a paused vLLM holds every new request. So
        the engine is resumed until it answers, then asked `/is_paused` once more after
        `LATE_PAUSE_SETTLE_S` and resumed again while it reports paused. It stops when a caller
        pauses the engines on purpose (Pause) or at `close()`.
        """
        epoch = self.epoch
        backoff_s = 0.1
        while epoch == self.epoch:
            try:
                await engine.client.resume()
                await asyncio.sleep(LATE_PAUSE_SETTLE_S)
                if epoch != self.epoch or not await engine.client.is_paused():
                    log.info("engine_resumed_late", engine=engine.url)
                    return
                log.warning("engine_paused_late", engine=engine.url)
            except EngineRejected as exc:  # e.g. no dev mode: asking again cannot help
                log.warning("engine_resume_failed", engine=engine.url, error=str(exc))
                return
            except EngineError as exc:
                log.warning("engine_resume_failed", engine=engine.url, error=str(exc))
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, LATE_RESUME_MAX_BACKOFF_S)
            except Exception as exc:  # e.g. the HTTP session closed at shutdown: nothing left to do
                log.warning("engine_resume_failed", engine=engine.url, error=repr(exc))
                return
