"""Transport mapping of an engine's capability facts (`facade.views.EngineView`) to
`rollout.v1.EngineInfo` fields."""

from __future__ import annotations

from typing import Any

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.facade.views import EngineView


def engine_info_extras(engine: EngineView) -> dict[str, Any]:
    """The capability fields of `rollout.v1.EngineInfo` for one engine, as keyword arguments
    (none for an engine that left the pool while the answer was built)."""
    if not engine.known:
        return {}
    extras: dict[str, Any] = {
        "problems": list(engine.problems),
        "usable": engine.usable,
        "kind": engine.kind,
    }
    if engine.health_error:
        extras["health_error"] = engine.health_error
    caps = engine.capabilities
    if caps is not None:
        extras["warnings"] = list(caps.warnings)
        message = pb.EngineCapabilities(
            logprobs_mode=caps.logprobs_mode,
            model=caps.model,
            max_model_len=caps.max_model_len or 0,
        )
        for name, value in (
            ("scale_out", caps.scale_out),
            ("dev_mode", caps.dev_mode),
            ("moe", caps.is_moe),
            ("routed_experts", caps.routed_experts),
        ):
            if value is not None:
                setattr(message, name, value)
        extras["capabilities"] = message
    return extras
