"""Resuming engines after a pause: within the caller's deadline, or later in the background.

A paused vLLM holds every new request, so an engine whose pause or resume did not answer in time
must not stay paused: `Resumes` keeps resuming it in the background until it answers, and stops
as soon as a caller pauses the engines on purpose or at shutdown (`close`).

"On purpose" is fleet-wide. Every Pause bumps `epoch` here and, through the fanout, on the
sibling workers; and it bumps the fleet's pause epoch in the shared state store
(`PauseEpochs`, `bump_fleet`) before it pauses the engines, since the engines are shared by every
replica: a late resume on replica B reads the fleet epoch before each resume and stops once it
moved, so it never undoes the Pause that replica A ran for a weight update meanwhile.

The fleet epoch's baseline is read when the resume starts (concurrently with its first attempt,
so that it costs the resume no time), so a Pause that lands while the resume is still waiting on
the hung engine counts too. What is left: a Pause whose bump lands between a late resume's read
and the engine running that resume (one store read and one HTTP call) is still undone.

The store unreachable: a late resume does not resume on a guess. It keeps asking the store (and
resumes once it answers with an unmoved epoch), stops on the local rule (`epoch`) or at `close`,
and logs `engine_resume_waits_for_store`. Resuming blindly could let an engine generate under a
weight update (tokens of mixed weights, labelled as one version: a silent corruption of the
training data); an engine left paused holds requests, which shows and is ended by any Resume. A
Pause whose bump fails is logged (`pause_epoch_not_shared`) and still pauses the engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

from rollout_grpc.server.domain.errors import Unavailable
from rollout_grpc.server.engines.api import ControlAction, EngineError, EngineRejected
from rollout_grpc.server.engines.pool import EngineHandle
from rollout_grpc.server.rollout.engine_fanout import StepFailed
from rollout_grpc.server.state.api import PauseEpochs

log = structlog.get_logger(__name__)

#: How long after a late resume the engine is asked again whether a late pause paused it.
LATE_PAUSE_SETTLE_S = 1.0
#: Upper bound of the wait between late resumes of an engine that does not answer.
LATE_RESUME_MAX_BACKOFF_S = 5.0
#: Longest a Pause waits for the store to bump the fleet's pause epoch before it pauses anyway.
EPOCH_BUMP_TIMEOUT_S = 2.0


class Resumes:
    """Resumes with bounded retries, and the background resumes of engines that did not answer."""

    def __init__(self, attempts: int = 3, epochs: PauseEpochs | None = None) -> None:
        self._attempts = attempts
        self._background: set[asyncio.Task[Any]] = set()
        #: Bumped by every Pause: a late resume started before it must not undo it.
        self.epoch = 0
        #: The fleet's pause epoch in the shared store (None: this process is the whole fleet).
        self._epochs = epochs
        #: Whether `engine_resume_waits_for_store` was logged since the store last answered.
        self._store_down_logged = False

    def paused_on_purpose(self) -> None:
        """A Pause ran (here or on a sibling): late resumes started before it stop."""
        self.epoch += 1

    async def bump_fleet(self) -> None:
        """A Pause starts on this process: bump the fleet's epoch (every replica's late resumes
        stop) before the engines are paused. Bounded by `EPOCH_BUMP_TIMEOUT_S`; a store that does
        not answer is logged and the Pause goes on (the engines' pause is what the caller asked)."""
        if self._epochs is None:
            return
        try:
            await asyncio.wait_for(self._epochs.bump_pause_epoch(), EPOCH_BUMP_TIMEOUT_S)
        except (Unavailable, TimeoutError) as exc:
            log.warning("pause_epoch_not_shared", error=getattr(exc, "message", "no answer in time"))

    async def _fleet_epoch(self) -> int | None:
        """The fleet's pause epoch; None when the store does not answer (logged once per outage)."""
        if self._epochs is None:
            return 0
        try:
            epoch = await asyncio.wait_for(self._epochs.pause_epoch(), EPOCH_BUMP_TIMEOUT_S)
        except (Unavailable, TimeoutError) as exc:
            if not self._store_down_logged:
                self._store_down_logged = True
                log.warning(
                    "engine_resume_waits_for_store", error=getattr(exc, "message", "no answer in time")
                )
            return None
        self._store_down_logged = False
        return epoch

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

    async def _fleet_now(self, epoch: int) -> int | None:
        """The fleet's pause epoch, waiting (with backoff) for a store that does not answer rather
        than guessing; None once this process paused on purpose (`epoch` moved) meanwhile."""
        backoff_s = 0.1
        while epoch == self.epoch:
            now = await self._fleet_epoch()
            if now is not None:
                return now
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, LATE_RESUME_MAX_BACKOFF_S)
        return None

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
        background (a paused vLLM holds every new request), from the fleet epoch read as it began."""
        baseline = asyncio.ensure_future(self._fleet_epoch()) if self._epochs is not None else None
        if baseline is not None:  # referenced until it finishes on its own; `close` cancels it
            self._background.add(baseline)
            baseline.add_done_callback(self._background.discard)
        try:
            await self.resume_one(engine)
        except asyncio.CancelledError:
            self.spawn(self.later(engine, baseline))
            raise

    async def later(self, engine: EngineHandle, baseline: asyncio.Future[int | None] | None = None) -> None:
        """Resume, in the background, an engine whose pause or resume did not answer in time.

        A hung engine still runs the unanswered pause when it wakes up (the request waits in its
        socket buffer), possibly after this resume, and a paused vLLM holds every new request. So
        the engine is resumed until it answers, then asked `/is_paused` once more after
        `LATE_PAUSE_SETTLE_S` and resumed again while it reports paused. It stops when a caller
        pauses the engines on purpose (Pause), here or on any replica (the fleet epoch moved from
        `baseline`, the one read when the resume began), or at `close()`; the store unreachable,
        it waits for it rather than resume on a guess (module docstring).
        """
        epoch = self.epoch
        fleet = await baseline if baseline is not None else None
        if fleet is None:
            fleet = await self._fleet_now(epoch)
        backoff_s = 0.1
        while epoch == self.epoch:
            try:
                if await self._fleet_now(epoch) != fleet:
                    log.info("engine_resume_stopped_by_pause", engine=engine.url)
                    return
                await engine.client.resume()
                await asyncio.sleep(LATE_PAUSE_SETTLE_S)
                if await self._fleet_now(epoch) != fleet:
                    log.info("engine_resume_stopped_by_pause", engine=engine.url)
                    return
                if not await engine.client.is_paused():
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
