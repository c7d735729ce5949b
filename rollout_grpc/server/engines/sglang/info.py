"""What an SGLang engine says about itself, and what the service makes of it.

Reads `/v1/models` (served name and `max_model_len`, the reliable context length) and the flat
`/server_info` (`dataclasses.asdict(server_args)`; older builds serve it only as
`/get_server_info`), docs/sglang-http-api.md §6. The facts used:

* `enable_return_routed_experts`: R3 is returned (with the request flag the adapter sends);
* `skip_tokenizer_init`: no text and no stop strings (a warning: token-only rollouts still work);
* `served_model_name`, `context_length` where `/v1/models` does not say.

SGLang reports neither an MoE flag nor the model's `num_experts_per_tok`; the raw int32 routing
carries no shape, so R3 also needs this replica's `--sglang-experts-topk`. An engine with routing
on but no top-k configured is reported with routed experts off and a warning naming that flag.
None of vLLM's problems exist here (no scale-out or development router to turn on).
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from rollout_grpc.server.engines.api import EngineCapabilities, EngineRejected, ServedModel

#: The SGLang server flag that makes it return routed experts (R3).
ROUTED_EXPERTS_FLAG: Final = "--enable-return-routed-experts"
#: This replica's flag that gives the top-k SGLang's raw routing bytes are shaped with.
TOPK_FLAG: Final = "--sglang-experts-topk"


class SglangEngine(Protocol):
    """What the probes need of the adapter (`adapter.SglangEngine`)."""

    experts_topk: int | None

    async def _json(self, method: str, path: str) -> Any: ...

    async def models(self) -> list[ServedModel]: ...


async def read_server_info(client: SglangEngine) -> dict[str, Any]:
    """`/server_info`, or the deprecated `/get_server_info` of older builds."""
    try:
        body = await client._json("GET", "/server_info")
    except EngineRejected as exc:
        if not exc.not_found:
            raise
        body = await client._json("GET", "/get_server_info")
    return body if isinstance(body, dict) else {}


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def classify(info: dict[str, Any], models: list[ServedModel], experts_topk: int | None) -> EngineCapabilities:
    """Capabilities and warnings from the probe results (pure, for tests)."""
    routed = info.get("enable_return_routed_experts")
    routed = routed if isinstance(routed, bool) else None
    served = info.get("served_model_name")
    model = models[0].id if models else (served if isinstance(served, str) else "")
    length = models[0].max_model_len if models else None
    caps = EngineCapabilities(
        model=model,
        max_model_len=length if length is not None else _int(info.get("context_length")),
        # Routing is captured only on MoE models; a dense engine says nothing either way.
        is_moe=True if routed else None,
        routed_experts=routed and bool(experts_topk) if routed is not None else None,
        routed_experts_flag=f"{ROUTED_EXPERTS_FLAG} (and this replica with {TOPK_FLAG})",
    )
    if routed and not experts_topk:
        caps.warnings.append(
            "the engine returns routed experts as raw int32 without a shape and does not report the "
            f"model's top-k: start this replica with {TOPK_FLAG} K (num_experts_per_tok) to use R3"
        )
    if info.get("skip_tokenizer_init") is True:
        caps.warnings.append(
            "the engine runs with --skip-tokenizer-init: no text and no stop strings (token ids only)"
        )
    return caps


async def check(client: SglangEngine) -> EngineCapabilities:
    """Probe one SGLang engine and classify it (`SglangEngine.capabilities`)."""
    models = await client.models()
    info = await read_server_info(client)
    return classify(info, models, client.experts_topk)
