"""An in-memory engine implementing `EngineAdapter`: scripted deltas, errors and hangs, no HTTP.

Each generate call takes the next script from the engine's queue (the last one repeats). A script
is a list of steps: an `EngineDelta`, `EngineUsage` or `EngineFinal` is yielded, an exception is
raised, `HANG` waits until the call is cancelled. `calls` records every `EngineCall`, `started`
is set when a call has yielded its first event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import EllipsisType

from rollout_grpc.server.domain.chat import ChatRenderRequest, ServedModel
from rollout_grpc.server.domain.model import WeightSpan
from rollout_grpc.server.engines.api import (
    ControlAction,
    EngineCall,
    EngineCapabilities,
    EngineDelta,
    EngineEvent,
    EngineFinal,
    EngineHealth,
    FinishKind,
    MemoryRelease,
    Rendered,
    TensorSpec,
    TransferGroup,
    WeightAction,
)

#: A script step that never ends (an engine that went silent).
HANG = object()

Step = EngineEvent | BaseException | object


def tokens(*ids: int, logprob: float = -0.5) -> EngineDelta:
    """A delta of these token ids, each with `logprob`."""
    return EngineDelta(list(ids), [logprob] * len(ids))


def final(finish: FinishKind = FinishKind.LENGTH, n: int = 0, version: str = "v1") -> EngineFinal:
    """A final result whose `n` tokens (this call's) were made under `version`."""
    return EngineFinal(finish, None, [WeightSpan(version, 0, n)] if n else [])


@dataclass
class FakeEngine:
    """A scripted engine."""

    url: str
    scripts: list[list[Step]] = field(default_factory=list)
    healthy: bool = True
    calls: list[EngineCall] = field(default_factory=list)
    #: Checkpoint paths loaded; memory released / taken back and transfer steps, in order.
    loaded: list[str] = field(default_factory=list)
    memory: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    paused: bool = False
    kind: str = "fake"
    missing_route_hint: str = "the fake engine serves every route"

    def control_route(self, action: ControlAction) -> str:
        return f"/fake/{action}"

    def engine_request_id(self, call_id: str) -> str:
        return f"fake-{call_id}"

    async def generate(self, call: EngineCall) -> AsyncIterator[EngineEvent]:
        self.calls.append(call)
        script = self.scripts.pop(0) if len(self.scripts) > 1 else list(self.scripts[0])
        for step in script:
            if step is HANG:
                await asyncio.Event().wait()
            if isinstance(step, BaseException):
                raise step
            self.started.set()
            yield step  # type: ignore[misc]

    async def health(self, timeout: float = 2.0) -> EngineHealth:
        return EngineHealth(self.healthy, "" if self.healthy else "the fake engine is marked unhealthy")

    async def abort_requests(self, engine_request_ids: list[str]) -> None:
        self.aborted.extend(engine_request_ids)

    async def render_text(self, text: str, model: str = "") -> Rendered:
        return Rendered([ord(c) for c in text])

    async def render_chat(self, request: ChatRenderRequest) -> Rendered:
        return Rendered([1, 2, 3])

    async def pause(self, mode: str, timeout: float | EllipsisType | None = ...) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def update_weight_version(self, version: str) -> None:
        return None

    async def weight_version(self) -> str:
        return "v1"

    def weight_route(self, action: WeightAction) -> str:
        return f"/fake/{action}"

    async def load_checkpoint(self, path: str, timeout: float | None) -> None:
        self.loaded.append(path)

    async def transfer_ranks(self) -> int:
        return 1

    async def init_transfer(self, group: TransferGroup, rank_offset: int, timeout: float | None) -> None:
        self.memory.append(("init_transfer", (str(rank_offset),)))

    async def receive_weights(
        self, group: TransferGroup, tensors: Sequence[TensorSpec], timeout: float | None
    ) -> None:
        self.memory.append(("receive_weights", tuple(t.name for t in tensors)))

    async def release_memory(self, release: MemoryRelease) -> None:
        self.memory.append(("release", release.tags))

    async def resume_memory(self, tags: tuple[str, ...]) -> None:
        self.memory.append(("resume", tags))

    async def models(self) -> list[ServedModel]:
        return [ServedModel("fake")]

    async def capabilities(self, raw_logprobs: str) -> EngineCapabilities | None:
        return None  # nothing to probe: the pool records no capabilities for a fake engine
