"""Engine capability check: can this engine serve the rollout contract, and if not, why.

Run at start and whenever an engine joins or comes back healthy (`EnginePool(capability_check=...)`).
Each adapter classifies its own engine (`EngineAdapter.capabilities`: vLLM's probes and flags are
in `engines/vllm/info.py`); this module records the outcome on the handle and logs it. An engine
with a *problem* is not routed to (`EngineHandle.usable`), and the problem names the exact engine
flag to add; it shows in the log, in GetServerInfo (`EngineInfo.problems`) and in health
(NOT_SERVING when no engine is usable). A *warning* leaves the engine in rotation.

The outcome is recorded on the handle (`EngineHandle.capabilities`), the one place the rest of the
service reads engine facts from. R3 (`return_routed_experts`) uses it: an engine serving a dense
model has no routing to return, and an MoE engine started without the routing flag returns none
(`EngineCapabilities.routed_experts_problem`); a Generate asking for R3 goes to an engine that can
return it, and fails with FAILED_PRECONDITION naming every usable engine and its reason when none
can (`Rollout`), instead of silently returning a sample without routing.
"""

from __future__ import annotations

from typing import Final

import structlog

from rollout_grpc.server.engines.api import EngineError
from rollout_grpc.server.engines.pool import EngineHandle

log = structlog.get_logger(__name__)

RAW_LOGPROBS_POLICIES: Final = ("refuse", "warn")


class CapabilityChecker:
    """`EnginePool`'s `capability_check`: classify one engine and record the outcome on its handle."""

    def __init__(self, raw_logprobs: str = "warn") -> None:
        if raw_logprobs not in RAW_LOGPROBS_POLICIES:
            raise ValueError(f"raw_logprobs must be one of {RAW_LOGPROBS_POLICIES}, got {raw_logprobs!r}")
        self.raw_logprobs = raw_logprobs

    async def __call__(self, engine: EngineHandle) -> None:
        try:
            caps = await engine.client.capabilities(self.raw_logprobs)
        except (EngineError, ValueError) as exc:  # ValueError: a body that is not JSON
            # Checked again at the next successful health probe.
            message = exc.message if isinstance(exc, EngineError) else f"unreadable answer: {exc}"
            engine.capabilities = None
            engine.problems = [f"capability check failed: {message}"]
            log.warning("engine_capability_check_failed", engine=engine.url, error=message)
            return
        if caps is None:
            return  # the adapter reports no capabilities (a test double): nothing to record
        engine.capabilities = caps
        engine.problems = list(caps.problems)
        engine.model = caps.model or engine.model
        fields = {
            "engine": engine.url,
            "model": caps.model,
            "scale_out": caps.scale_out,
            "dev_mode": caps.dev_mode,
            "logprobs_mode": caps.logprobs_mode or None,
            "moe": caps.is_moe,
            "routed_experts": caps.routed_experts,
            "max_model_len": caps.max_model_len,
        }
        if caps.problems:
            log.error("engine_not_usable", **fields, problems=caps.problems)
        else:
            log.info("engine_capabilities", **fields)
        for warning in caps.warnings:
            log.warning("engine_capability_warning", engine=engine.url, warning=warning)
