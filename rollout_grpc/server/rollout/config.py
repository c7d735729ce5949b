"""The knobs of the generation loop (`RolloutConfig`), read by the attempt loop and the engine call."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_grpc.server.domain import bounds


@dataclass(slots=True)
class RolloutConfig:
    """Knobs of the generation loop."""

    #: Engine calls per Generate (the first plus failovers).
    max_engine_attempts: int = 4
    #: Ask engines to batch tokens into fewer SSE events (vLLM's `stream_interval`). Every SSE
    #: event costs the service 25-50 us of CPU however few tokens it holds (bench/profile_notes.md),
    #: so batching upstream is the largest saving. Turn off for engines that reject it.
    engine_stream_interval: bool = True
    #: `stream_interval` for callers that want no deltas (`final_only`).
    final_only_stream_interval: int = 64
    #: Healthy engines that may fail the same request with an internal error before the request,
    #: not the engines, is held at fault (FAILED_PRECONDITION; no circuit breaker opens).
    max_request_failures: int = 2
    #: After an abort was requested, seconds to wait for the engine's final chunk before the
    #: generation ends ABORTED with what it has (an engine that never answers cannot hold it).
    abort_drain_s: float = 1.0
    #: Seconds the health probe that tells an engine-wide from a request-specific failure may take.
    health_probe_s: float = 2.0
    #: Most seconds before a caller's deadline that its sample is sent (10 % of the caller's time
    #: when that is less): see `bounds.deadline_margin_s`.
    deadline_margin_s: float = bounds.DEADLINE_MARGIN_S
    #: Most seconds before that the engine call is aborted upstream, so that the engine's final
    #: chunk arrives in time: see `bounds.deadline_abort_lead_s` and `deadline.py`.
    deadline_abort_lead_s: float = bounds.DEADLINE_ABORT_LEAD_S
