"""What an SGLang server adds on top of the shared engine core: the pause mode, prefix-matched
aborts, retraction counts and a prefix cache (``docs/sglang-http-api.md`` §4, §5).

Requests that arrive while paused wait in the core as *held* (SGLang's TokenizerManager blocks
them before tokenisation, so they are not yet known to the server): aborts by rid or
``abort_all`` do not reach them, and they start after ``/continue_generation``. Only *admitted*
requests (past that gate) are aborted, retracted or frozen.
"""

from __future__ import annotations

import asyncio
import collections

from aiohttp import web

from ..core import EngineCore, EngineRequest

PAUSE_MODES = ("abort", "retract", "in_place")
#: Token sequences remembered for ``cached_tokens`` (a stand-in for the radix cache).
CACHE_ENTRIES = 256


class SGLangState:
    """Per-engine SGLang state (``app[SGLANG_KEY]``)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.pause_mode: str | None = None
        self.retractions: collections.Counter[str] = collections.Counter()
        self._cache: collections.deque[tuple[int, ...]] = collections.deque(maxlen=CACHE_ENTRIES)

    # ------------------------------------------------------------------ requests
    def admitted(self) -> list[EngineRequest]:
        """Requests past the pause gate and not finished: what SGLang's rid table holds."""
        return [r for r in self.core.tracked() if r.admitted and not r.done.is_set()]

    def duplicate(self, rid: str) -> bool:
        return any(r.engine_id == rid and not r.done.is_set() for r in self.core.tracked())

    def abort(self, rid: str) -> list[EngineRequest]:
        """``/abort_request {"rid"}``: a no-op unless ``rid`` is in flight; then the scheduler aborts
        every request whose rid *starts with* it (so ``"a-1"`` also aborts ``"a-10"``)."""
        live = self.admitted()
        if not rid or all(r.engine_id != rid for r in live):
            return []
        hit = [r for r in live if r.engine_id.startswith(rid)]
        for r in hit:
            r.abort()
        return hit

    def abort_all(self) -> list[EngineRequest]:
        live = self.admitted()
        for r in live:
            r.abort()
        return live

    # ------------------------------------------------------------------ pause / continue
    async def pause(self, mode: str) -> None:
        """``abort``: abort everything admitted and return once it has ended; ``retract``: stop
        running requests and count a retraction (their KV is dropped, they re-prefill on
        continue); ``in_place``: freeze them with their KV. New requests are held in every mode."""
        core = self.core
        self.pause_mode = mode
        core.paused = True
        if mode == "abort":
            core.frozen = False
            aborted = self.abort_all()
            await asyncio.gather(*(r.done.wait() for r in aborted))
        else:
            core.frozen = True
            if mode == "retract":
                for r in self.admitted():
                    self.retractions[r.engine_id] += 1
        core.notify()

    def resume(self) -> None:
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
