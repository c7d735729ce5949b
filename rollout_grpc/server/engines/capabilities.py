"""Engine capability check: can this engine serve the rollout contract, and if not, why.

Run at start and whenever an engine joins or comes back healthy (`EnginePool.capability_check`).
Each engine is classified from `/v1/models`, `/server_info` and two cheap probes (`vllm_info.py`).
An engine with a *problem* is not routed to (`EngineHandle.usable`), and the problem names the exact
vLLM flag to add; it shows in the log, in GetServerInfo (`EngineInfo.problems`) and in health
(NOT_SERVING when no engine is usable). A *warning* leaves the engine in rotation.

* scale-out routes off (403): problem, add `--enable-scale-out`;
* development routes off (404): problem, set `VLLM_SERVER_DEV_MODE=1` (pause, resume, weight
  versions and abort-all depend on them);
* `--logprobs-mode raw_logprobs` (vLLM's default): a problem with the replica flag
  `--raw-logprobs refuse`, a warning with `warn`;
* `--logprobs-mode raw_logits|processed_logits`: problem (logits are not log-probabilities);
* an MoE model without routed experts: warning (R3 requests on it fail, see below).

The outcome is recorded on the handle (`EngineHandle.capabilities`), the one place the rest of the
service reads engine facts from. R3 (`return_routed_experts`) uses it: an engine serving a dense
model has no routing to return, and an MoE engine started without `--enable-return-routed-experts`
returns none (`EngineCapabilities.routed_experts_problem`); a Generate asking for R3 goes to an
engine that can return it, and fails with FAILED_PRECONDITION naming every usable engine and its
reason when none can (`Rollout`), instead of silently returning a sample without routing.
"""

from __future__ import annotations

from typing import Final

import structlog

from rollout_grpc.server.engines.api import EngineCapabilities, EngineError
from rollout_grpc.server.engines.pool import EngineHandle
from rollout_grpc.server.engines.vllm import info as vllm_info
from rollout_grpc.server.engines.vllm.adapter import VllmEngine

log = structlog.get_logger(__name__)

RAW_LOGPROBS_POLICIES: Final = ("refuse", "warn")
#: The logprobs mode the contract wants: log-probabilities of the distribution actually sampled.
WANTED_LOGPROBS_MODE: Final = "processed_logprobs"


def classify(
    *,
    scale_out: bool | None,
    dev_mode: bool | None,
    info: vllm_info.ServerInfo | None,
    model: str,
    max_model_len: int | None,
    raw_logprobs: str = "warn",
) -> EngineCapabilities:
    """Capabilities, problems and warnings from the probe results (pure, for tests)."""
    info = info or vllm_info.ServerInfo()
    caps = EngineCapabilities(
        scale_out=scale_out,
        dev_mode=dev_mode,
        logprobs_mode=info.logprobs_mode or "",
        is_moe=info.is_moe,
        routed_experts=info.routed_experts_enabled,
        model=model or info.served_model_name or "",
        max_model_len=max_model_len if max_model_len is not None else info.max_model_len,
    )
    if scale_out is False:
        caps.problems.append(
            "scale-out routes are off (/inference/v1/generate answers 403): restart `vllm serve` with "
            "--enable-scale-out"
        )
    if dev_mode is False:
        caps.problems.append(
            "development routes are off (/pause, /resume, /is_paused, /update_weight_version answer "
            "404), so pause, resume, weight versions and abort-all cannot work: start vLLM with the "
            "environment variable VLLM_SERVER_DEV_MODE=1"
        )
    mode = caps.logprobs_mode
    if mode.endswith("_logits"):
        caps.problems.append(
            f"--logprobs-mode is {mode}: the engine returns logits, not log-probabilities: restart "
            f"`vllm serve` with --logprobs-mode {WANTED_LOGPROBS_MODE}"
        )
    elif mode == "raw_logprobs":
        text = (
            "--logprobs-mode is raw_logprobs (vLLM's default): logprobs are taken before temperature, "
            "top-p/top-k and penalties, which skews importance ratios whenever sampling changes the "
            f"distribution: restart `vllm serve` with --logprobs-mode {WANTED_LOGPROBS_MODE}"
        )
        if raw_logprobs == "refuse":
            caps.problems.append(text + " (or run this replica with --raw-logprobs warn)")
        else:
            caps.warnings.append(text)
    if caps.is_moe and caps.routed_experts is False:
        caps.warnings.append(
            "MoE model without routed experts: requests with return_routed_experts fail on this engine; "
            "restart `vllm serve` with --enable-return-routed-experts to use R3"
        )
    return caps


class CapabilityChecker:
    """`EnginePool.capability_check`: classify one engine and record the outcome on its handle."""

    def __init__(self, raw_logprobs: str = "warn") -> None:
        if raw_logprobs not in RAW_LOGPROBS_POLICIES:
            raise ValueError(f"raw_logprobs must be one of {RAW_LOGPROBS_POLICIES}, got {raw_logprobs!r}")
        self.raw_logprobs = raw_logprobs

    async def __call__(self, engine: EngineHandle) -> None:
        client = engine.client
        if not isinstance(client, VllmEngine):
            return  # the probes below speak vLLM's HTTP surface; other adapters report their own
        try:
            model, max_model_len = await vllm_info.read_model(client)
            scale_out = await vllm_info.probe_scale_out(client)
            dev_mode = await vllm_info.probe_dev_mode(client)
            info = await vllm_info.read_server_info(client) if dev_mode else None
        except (EngineError, ValueError) as exc:  # ValueError: a body that is not JSON
            # Checked again at the next successful health probe.
            message = exc.message if isinstance(exc, EngineError) else f"unreadable answer: {exc}"
            engine.capabilities = None
            engine.problems = [f"capability check failed: {message}"]
            log.warning("engine_capability_check_failed", engine=engine.url, error=message)
            return
        caps = classify(
            scale_out=scale_out,
            dev_mode=dev_mode,
            info=info,
            model=model,
            max_model_len=max_model_len,
            raw_logprobs=self.raw_logprobs,
        )
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
