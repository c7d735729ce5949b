"""Which adapter speaks to an engine URL: the one module that knows every engine kind.

The pool, the domain and the front doors hold `EngineAdapter`s and never name a kind; the replica
(`app.py`) builds the pool with `adapter_factory`, which picks the adapter of each engine's kind
from the replica's URL -> kind table (`ServerConfig.engine_kinds`, filled from `sglang+http://...`
engine URLs by the settings; a URL not in it is vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from rollout_grpc.server.domain.vocabulary import DEFAULT_ENGINE_KIND, EngineKind
from rollout_grpc.server.engines.api import EngineAdapter, EngineTimeouts
from rollout_grpc.server.engines.sglang.adapter import SglangEngine
from rollout_grpc.server.engines.vllm.adapter import VllmEngine


@dataclass(frozen=True, slots=True)
class KindOptions:
    """Per-kind settings of the replica that an adapter needs and its engine does not report."""

    #: The model's `num_experts_per_tok`, which shapes SGLang's raw R3 bytes (None: R3 off there).
    sglang_experts_topk: int | None = None


#: Builds the adapter of one engine kind: (base URL, shared HTTP session, timeouts, options).
AdapterClass = Callable[[str, aiohttp.ClientSession, EngineTimeouts | None, KindOptions], EngineAdapter]


def _vllm(url: str, http: aiohttp.ClientSession, t: EngineTimeouts | None, _: KindOptions) -> EngineAdapter:
    return VllmEngine(url, http, t)


def _sglang(url: str, http: aiohttp.ClientSession, t: EngineTimeouts | None, o: KindOptions) -> EngineAdapter:
    return SglangEngine(url, http, t, experts_topk=o.sglang_experts_topk)


#: The adapter of every engine kind (`domain/vocabulary.EngineKind`; a test holds them equal).
KINDS: dict[EngineKind, AdapterClass] = {EngineKind.VLLM: _vllm, EngineKind.SGLANG: _sglang}
DEFAULT_KIND = DEFAULT_ENGINE_KIND


def adapter_factory(
    http: aiohttp.ClientSession,
    timeouts: EngineTimeouts | None = None,
    kinds: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
    options: KindOptions | None = None,
) -> Callable[[str], EngineAdapter]:
    """The pool's adapter factory: every engine URL gets its kind's adapter over `http`.

    `kinds` is the URL -> kind table, or a function returning the current one: it is read when an
    engine joins, so a reload that installs a new table before it changes the pool gives new
    engines the right adapter (the table is replaced, never edited in place: a table handed to
    another process or kept by the caller must not change under it).
    """
    current: Callable[[], Mapping[str, str]]
    if callable(kinds):
        current = kinds
    else:
        fixed: Mapping[str, str] = kinds if kinds is not None else {}

        def current() -> Mapping[str, str]:
            return fixed

    opts = options or KindOptions()

    def build(url: str) -> EngineAdapter:
        name = current().get(url.rstrip("/"), DEFAULT_KIND)
        if name not in KINDS:
            raise ValueError(f"engine {url}: unknown engine kind {name!r} (known: {', '.join(KINDS)})")
        return KINDS[EngineKind(name)](url, http, timeouts, opts)

    return build
