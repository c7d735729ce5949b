"""What a vLLM engine says about its own configuration, and what the service makes of it.

Reads `/v1/models`, `/server_info?config_format=json` and two cheap probes, and knows where vLLM
0.32 puts each fact in those bodies; nothing outside the adapter parses vLLM's JSON.

* `POST /inference/v1/abort_requests {"request_ids": []}` answers 200 (aborting nothing) with
  `--enable-scale-out` (or `--tokens-only`) and 403 `PermissionDeniedError` without it.
* `GET /is_paused` answers 200 with `VLLM_SERVER_DEV_MODE=1` and 404 without it; `/server_info`
  belongs to the same development router, so without dev mode the configuration is unknown.
* In the `/server_info` JSON (`vllm_config` is `VllmConfig` dumped by pydantic):
  `model_config.logprobs_mode` (`raw_logprobs` by default, `processed_logprobs` with
  `--logprobs-mode processed_logprobs`), `model_config.max_model_len`,
  `parallel_config.is_moe_model`, `aux_output_config.enable_return_routed_experts`. vLLM 0.32
  reports no vocabulary size there (the HF config is not part of the dump).

`classify` turns those facts into `EngineCapabilities` whose problems name the exact vLLM flag:

* scale-out routes off (403): problem, add `--enable-scale-out`;
* development routes off (404): problem, set `VLLM_SERVER_DEV_MODE=1` (pause, resume, weight
  versions and abort-all depend on them);
* `--logprobs-mode raw_logprobs` (vLLM's default): a problem with the replica flag
  `--raw-logprobs refuse`, a warning with `warn`;
* `--logprobs-mode raw_logits|processed_logits`: problem (logits are not log-probabilities);
* an MoE model without routed experts: warning (R3 requests on it fail).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol

import orjson

from rollout_grpc.server.domain.chat import ServedModel
from rollout_grpc.server.engines.api import EngineCapabilities, EngineRejected

#: The logprobs mode the contract wants: log-probabilities of the distribution actually sampled.
WANTED_LOGPROBS_MODE: Final = "processed_logprobs"
#: The vLLM flag that makes an MoE engine return routed experts (R3).
ROUTED_EXPERTS_FLAG: Final = "--enable-return-routed-experts"


class VllmEngine(Protocol):
    """What the probes need of the adapter (`adapter.VllmEngine`), which calls them."""

    async def _request(self, method: str, path: str, *, json_body: Any = None) -> tuple[int, bytes]: ...

    async def server_info(self) -> dict[str, Any]: ...

    async def models(self) -> list[ServedModel]: ...


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The facts of `/server_info` the service uses; None where the engine does not say."""

    logprobs_mode: str | None = None
    max_model_len: int | None = None
    is_moe: bool | None = None
    routed_experts_enabled: bool | None = None
    served_model_name: str | None = None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def parse_server_info(info: dict[str, Any]) -> ServerInfo:
    """The facts of a `/server_info?config_format=json` body (`{"vllm_config": {...}, ...}`)."""
    config = _dict(info.get("vllm_config"))
    model = _dict(config.get("model_config"))
    served = model.get("served_model_name")
    if isinstance(served, list):
        served = served[0] if served else None
    mode = model.get("logprobs_mode")
    return ServerInfo(
        logprobs_mode=mode if isinstance(mode, str) else None,
        max_model_len=_int(model.get("max_model_len")),
        is_moe=_bool(_dict(config.get("parallel_config")).get("is_moe_model")),
        routed_experts_enabled=_bool(
            _dict(config.get("aux_output_config")).get("enable_return_routed_experts")
        ),
        served_model_name=served if isinstance(served, str) else None,
    )


async def probe_scale_out(client: VllmEngine) -> bool | None:
    """True when the scale-out routes answer, False on 403/404, None on any other answer."""
    status, _ = await client._request("POST", "/inference/v1/abort_requests", json_body={"request_ids": []})
    if status == 200:
        return True
    return False if status in (403, 404) else None


async def probe_dev_mode(client: VllmEngine) -> bool | None:
    """True when the development routes answer (`VLLM_SERVER_DEV_MODE=1`), False on 404."""
    status, _ = await client._request("GET", "/is_paused")
    if status == 200:
        return True
    return False if status == 404 else None


async def read_server_info(client: VllmEngine) -> ServerInfo | None:
    """The engine's configuration, or None when `/server_info` is not served (dev mode off)."""
    try:
        return parse_server_info(await client.server_info())
    except EngineRejected:
        return None
    except orjson.JSONDecodeError:
        return None


async def read_model(client: VllmEngine) -> tuple[str, int | None]:
    """(served model name, max_model_len) of the first model of `/v1/models`."""
    models = await client.models()
    if not models:
        return "", None
    return models[0].id, models[0].max_model_len


def classify(
    *,
    scale_out: bool | None,
    dev_mode: bool | None,
    info: ServerInfo | None,
    model: str,
    max_model_len: int | None,
    raw_logprobs: str = "warn",
) -> EngineCapabilities:
    """Capabilities, problems and warnings from the probe results (pure, for tests)."""
    info = info or ServerInfo()
    caps = EngineCapabilities(
        scale_out=scale_out,
        dev_mode=dev_mode,
        logprobs_mode=info.logprobs_mode or "",
        is_moe=info.is_moe,
        routed_experts=info.routed_experts_enabled,
        model=model or info.served_model_name or "",
        max_model_len=max_model_len if max_model_len is not None else info.max_model_len,
        routed_experts_flag=ROUTED_EXPERTS_FLAG,
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
            f"restart `vllm serve` with {ROUTED_EXPERTS_FLAG} to use R3"
        )
    return caps


async def check(client: VllmEngine, raw_logprobs: str) -> EngineCapabilities:
    """Probe one vLLM engine and classify it (`VllmEngine.capabilities`)."""
    model, max_model_len = await read_model(client)
    scale_out = await probe_scale_out(client)
    dev_mode = await probe_dev_mode(client)
    info = await read_server_info(client) if dev_mode else None
    return classify(
        scale_out=scale_out,
        dev_mode=dev_mode,
        info=info,
        model=model,
        max_model_len=max_model_len,
        raw_logprobs=raw_logprobs,
    )
