"""What an SGLang server adds on top of the shared engine core: the pause mode and its lock,
scheduler-side aborts, the waiting queue, retraction counts and a prefix cache
(``docs/sglang-http-api.md`` §4, §5; SGLang 0.5.23 ``tokenizer_manager.py`` and ``scheduler.py``).

Requests that arrive while paused wait in the core as *held*: SGLang's TokenizerManager has
already registered their rid (``_init_req_state``, TM:926) but blocks them before tokenisation
(TM:938), so the scheduler does not know them. An abort by rid of a held request is therefore
**lost**, and marks the rid ``abort_sent`` so every later abort of it is ignored (TM:2241-2253);
``abort_all`` does not reach held requests either. Only *admitted* requests (past the gate) are
aborted, retracted or frozen.

Scheduler aborts follow SCH:5686-5812: a request in the waiting queue (here: one retracted by a
``retract`` pause) is popped at once and answered with the tokenizer's reduced "Abort in waiting
queue" output (TM:3577-3640, ``queued_aborts``); a running request gets ``to_finish`` and ends
after one more forward pass, which a request frozen ``in_place`` never takes.

``/pause_generation`` and ``/continue_generation`` take one lock (``is_pause_cond``,
TM:2267-2286). ``mode="abort"`` holds it while it aborts everything and waits until no admitted
request is left: over an ``in_place`` pause that never happens, so the pause hangs and a
``/continue_generation`` sent meanwhile waits behind it, as on SGLang 0.5.23 (the engine is
wedged until restarted; ``wedged`` says so for tests).
"""

from __future__ import annotations

import asyncio
import collections
import time

from aiohttp import web

from ..core import EngineCore, EngineRequest

PAUSE_MODES = ("abort", "retract", "in_place")
#: Token sequences remembered for ``cached_tokens`` (a stand-in for the radix cache).
CACHE_ENTRIES = 256


class SGLangState:
    """Per-engine SGLang state (``app[SGLANG_KEY]``)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        #: ``/server_info``'s ``startup_time`` (the tokenizer manager's start, a wall-clock time).
        self.startup_time = time.time()
        self.pause_mode: str | None = None
        self.retractions: collections.Counter[str] = collections.Counter()
        self._cache: collections.deque[tuple[int, ...]] = collections.deque(maxlen=CACHE_ENTRIES)
        #: SGLang's ``is_pause_cond``: pause and continue run one at a time.
        self.pause_lock = asyncio.Lock()
        #: Rids whose abort the tokenizer already sent (``ReqState.abort_sent``): later aborts of
        #: them are ignored until the request ends.
        self.abort_sent: set[str] = set()
        #: Rids popped from the waiting queue by an abort: they end with the reduced output.
        self.queued_aborts: set[str] = set()
        #: True while an abort pause waits for requests that cannot end (frozen ``in_place``).
        self.wedged = False

    # ------------------------------------------------------------------ requests
    def admitted(self) -> list[EngineRequest]:
        """Requests past the pause gate and not finished: what SGLang's scheduler holds."""
        return [r for r in self.core.tracked() if r.admitted and not r.done.is_set()]

    def duplicate(self, rid: str) -> bool:
        return any(r.engine_id == rid and not r.done.is_set() for r in self.core.tracked())

    def _queued(self) -> bool:
        """Admitted requests sit in the waiting queue (a ``retract`` pause put them there)."""
        return self.pause_mode == "retract"

    def _scheduler_abort(self, reqs: list[EngineRequest]) -> None:
        for r in reqs:
            if self._queued():
                self.queued_aborts.add(r.engine_id)
                r.abort()  # popped from the queue: no forward pass needed
            else:
                r.finish_after_next_pass()

    def abort(self, rid: str) -> list[EngineRequest]:
        """``/abort_request {"rid"}``: the tokenizer drops an unknown rid and a repeated one; else
        the scheduler aborts every request it holds whose rid *starts with* it. A held request is
        not in the scheduler: its abort is lost (and later ones are ignored)."""
        known = [r for r in self.core.tracked() if r.engine_id == rid and not r.done.is_set()]
        if not rid or not known or rid in self.abort_sent:
            return []
        self.abort_sent.add(rid)
        hit = [r for r in self.admitted() if r.engine_id.startswith(rid)]
        self._scheduler_abort(hit)
        return hit

    def abort_all(self) -> list[EngineRequest]:
        live = self.admitted()
        self._scheduler_abort(live)
        return live

    def forget(self, rid: str) -> None:
        """The request ended: its tokenizer state is gone."""
        self.abort_sent.discard(rid)
        self.queued_aborts.discard(rid)
        self.retractions.pop(rid, None)

    # ------------------------------------------------------------------ pause / continue
    async def pause(self, mode: str) -> None:
        """``abort``: under the lock, abort everything admitted until nothing admitted is left
        (the scheduler's own pause state is untouched); ``retract``: move running requests to the
        waiting queue (a retraction each: KV dropped, re-prefilled on continue); ``in_place``:
        freeze them with their KV. New requests are held in every mode."""
        core = self.core
        async with self.pause_lock:
            core.paused = True
            core.notify()
            if mode == "abort":
                live = self.abort_all()
                if any(not r.done.is_set() for r in live) and core.frozen and not self._queued():
                    self.wedged = True
                    core.notify()
                await core.wait_until(lambda: not self.admitted())
                self.wedged = False
                if self.pause_mode is None:
                    self.pause_mode = "abort"
                return
            self.pause_mode = mode
            core.frozen = True
            if mode == "retract":
                for r in self.admitted():
                    self.retractions[r.engine_id] += 1
            core.notify()

    async def resume(self) -> None:
        """``/continue_generation``: waits for the lock (behind a running abort pause)."""
        self.core.notify()  # a waiter may watch for this call arriving (``stats.resume_calls``)
        async with self.pause_lock:
            self.pause_mode = None
            self.core.resume()

    # ------------------------------------------------------------------ cache
    def cached_tokens(self, prompt_ids: list[int]) -> int:
        """Longest prefix of the prompt already computed by an earlier request (at most all but
        the last prompt token, which is always recomputed)."""
        best = 0
        limit = len(prompt_ids) - 1
        for seq in self._cache:
            n = 0
            for a, b in zip(seq, prompt_ids[:limit], strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def remember(self, token_ids: list[int]) -> None:
        self._cache.append(tuple(token_ids))

    def flush_cache(self) -> bool:
        """``/flush_cache``: refused while requests hold KV (running, or frozen ``in_place``); a
        ``retract`` pause has released it."""
        if self.admitted() and self.pause_mode != "retract":
            return False
        self._cache.clear()
        return True


#: Where the SGLang app keeps its ``SGLangState``.
SGLANG_KEY: web.AppKey[SGLangState] = web.AppKey("sim_sglang", SGLangState)
