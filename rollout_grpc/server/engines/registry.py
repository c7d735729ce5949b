"""Which adapter speaks to an engine URL: the one module that knows every engine kind.

The pool, the domain and the front doors hold `EngineAdapter`s and never name a kind; the replica
(`app.py`) builds the pool with `adapter_factory`, which picks the adapter of each engine's kind.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp

from rollout_grpc.server.engines.api import EngineAdapter, EngineTimeouts
from rollout_grpc.server.engines.vllm.adapter import VllmEngine

#: Builds the adapter of one engine kind: (base URL, shared HTTP session, timeouts) -> adapter.
AdapterClass = Callable[[str, aiohttp.ClientSession, EngineTimeouts | None], EngineAdapter]

#: Every engine kind the replica can talk to.
KINDS: dict[str, AdapterClass] = {"vllm": VllmEngine}
DEFAULT_KIND = "vllm"


def adapter_factory(
    http: aiohttp.ClientSession, timeouts: EngineTimeouts | None = None
) -> Callable[[str], EngineAdapter]:
    """The pool's adapter factory: every engine URL gets its kind's adapter over `http`."""

    def build(url: str) -> EngineAdapter:
        return KINDS[DEFAULT_KIND](url, http, timeouts)

    return build
