"""What a vLLM engine says about its own configuration: part of the vLLM adapter (with `vllm.py`).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from rollout_grpc.server.engines.api import EngineRejected
from rollout_grpc.server.engines.vllm.adapter import VllmEngine


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
