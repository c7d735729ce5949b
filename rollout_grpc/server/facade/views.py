"""What the doors read about the replica, as plain values: the server-info view.

The doors never hold the engine pool or the admission queue (they import nothing below the facade:
pyproject's "the doors go down through the facade only" contract); `RolloutFacade.server_info`
copies what GetServerInfo and the OpenAI door's error redaction need into these values.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CapabilityView:
    """What the capability check found out about one engine (None where the engine did not say)."""

    logprobs_mode: str = ""
    model: str = ""
    max_model_len: int | None = None
    scale_out: bool | None = None
    dev_mode: bool | None = None
    is_moe: bool | None = None
    routed_experts: bool | None = None
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as GetServerInfo reports it: its status and its capability facts."""

    url: str
    healthy: bool
    draining: bool
    in_flight: int
    paused: bool
    weight_version: str
    model: str
    #: The engine kind (`vllm`, `sglang`); empty when the pool no longer holds the engine.
    kind: str = ""
    #: False: the engine receives no generations (`problems` say why).
    usable: bool = True
    problems: tuple[str, ...] = ()
    #: Why the last health probe failed; empty when healthy.
    health_error: str = ""
    capabilities: CapabilityView | None = None
    #: False when the engine left the pool between the status read and the capability read.
    known: bool = True


@dataclass(frozen=True, slots=True)
class ServerView:
    """The replica as GetServerInfo reports it."""

    engines: list[EngineView] = field(default_factory=list)
    #: Generations admitted and running, and waiting for admission.
    in_flight: int = 0
    queued: int = 0
