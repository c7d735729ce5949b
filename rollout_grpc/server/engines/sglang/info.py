"""What an SGLang engine says about itself, and what the service makes of it.

Reads `/v1/models` (served name and `max_model_len`, the reliable context length) and the flat
`/server_info` (`dataclasses.asdict(server_args)`; older builds serve it only as
`/get_server_info`), docs/sglang-http-api.md §6. The facts used:

* `enable_return_routed_experts`: R3 is returned (with the request flag the adapter sends);
* `skip_tokenizer_init`: no text and no stop strings (a warning: token-only rollouts still work);
* `served_model_name`, `context_length` where `/v1/models` does not say;
* `enable_deterministic_inference`: without it SGLang **ignores `sampling_seed`** (0.5.23
  `sampling/sampling_batch_info.py` 157-172 builds the seed tensor only in that mode), so the
  adapter refuses a seeded call on such an engine (`SEED_FLAG` named) and this warns;
* `incremental_streaming_output`: without it every stream chunk repeats all ids and logprobs so
  far (O(n^2) bytes: ~1.1 GB of JSON for one 8k-token rollout), a warning naming `STREAM_FLAG`.

Logprobs: SGLang has no logprobs-mode setting. By default it returns `log_softmax(logits / T)`,
temperature-scaled but **not renormalised after top-p/top-k/min-p** (0.5.23
`layers/sampler.py` 192-198, 271-323), which is vLLM's `processed_logprobs` whenever no truncation
applies; with the environment variable `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, which `/server_info`
does not show, they are raw. The capabilities report `LOGPROBS_MODE` and the same `--raw-logprobs`
policy as vLLM's holds: `warn` warns; `refuse` makes the adapter refuse a call whose sampling
truncates (its logprobs would not be those of the distribution sampled), naming the knob.

SGLang reports neither an MoE flag nor the model's `num_experts_per_tok`; the raw int32 routing
carries no shape, so R3 also needs this replica's `--sglang-experts-topk`. An engine with routing
on but no top-k configured is reported with routed experts off and a warning naming that flag.
None of vLLM's problems exist here (no scale-out or development router to turn on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol

from rollout_grpc.server.domain.chat import ServedModel
from rollout_grpc.server.engines.api import EngineCapabilities, EngineRejected

#: SGLang's logprob definition, as reported in `EngineCapabilities.logprobs_mode`.
LOGPROBS_MODE: Final = "temperature_scaled_logprobs"
#: The SGLang server flag without which `sampling_seed` is ignored.
SEED_FLAG: Final = "--enable-deterministic-inference"
#: The SGLang server flag that makes stream chunks deltas instead of everything so far.
STREAM_FLAG: Final = "--incremental-streaming-output"
#: The environment variable that makes SGLang's logprobs raw (invisible in `/server_info`).
ORIGINAL_LOGPROB_ENV: Final = "SGLANG_RETURN_ORIGINAL_LOGPROB"
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


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What the adapter checks each call against; None where the engine did not say (an older
    build): nothing is refused on a fact that is not known."""

    #: `enable_deterministic_inference`: False means `sampling_seed` is ignored.
    deterministic: bool | None = None
    #: `incremental_streaming_output`: False means cumulative (O(n^2)) streams.
    incremental: bool | None = None
    #: The replica's `--raw-logprobs` policy (`refuse` or `warn`).
    raw_logprobs: str = "warn"
    #: The context length (`/v1/models` `max_model_len`, else `context_length`): SGLang refuses a
    #: call whose prompt plus `max_new_tokens` exceeds it (docs/sglang-http-api.md §2.2).
    context_length: int | None = None


def facts(info: dict[str, Any], raw_logprobs: str, context_length: int | None = None) -> ServerFacts:
    """The per-call facts of a `/server_info` body (and the context length the probe found)."""
    return ServerFacts(
        deterministic=_bool(info.get("enable_deterministic_inference")),
        incremental=_bool(info.get("incremental_streaming_output")),
        raw_logprobs=raw_logprobs,
        context_length=context_length if context_length is not None else _int(info.get("context_length")),
    )


def seed_refusal(url: str) -> str:
    """Why a seeded call is refused on an engine that ignores seeds."""
    return (
        f"engine {url} is SGLang without {SEED_FLAG}, which ignores sampling_seed (sampling would "
        f"not be reproducible): restart SGLang with {SEED_FLAG}, or send no seed"
    )


def truncation_refusal(url: str, knob: str) -> str:
    """Why a truncating call is refused under `--raw-logprobs refuse`."""
    return (
        f"engine {url} is SGLang, whose logprobs are temperature-scaled but not renormalised after "
        f"{knob}, so they would not be those of the distribution sampled; this replica runs with "
        "--raw-logprobs refuse: send the call without it, use a vLLM engine with --logprobs-mode "
        "processed_logprobs, or run this replica with --raw-logprobs warn"
    )


def classify(
    info: dict[str, Any], models: list[ServedModel], experts_topk: int | None, raw_logprobs: str = "warn"
) -> EngineCapabilities:
    """Capabilities and warnings from the probe results (pure, for tests)."""
    routed = info.get("enable_return_routed_experts")
    routed = routed if isinstance(routed, bool) else None
    served = info.get("served_model_name")
    model = models[0].id if models else (served if isinstance(served, str) else "")
    length = models[0].max_model_len if models else None
    caps = EngineCapabilities(
        model=model,
        max_model_len=length if length is not None else _int(info.get("context_length")),
        logprobs_mode=LOGPROBS_MODE,
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
    known = facts(info, raw_logprobs)
    if known.deterministic is False:
        caps.warnings.append(
            f"the engine runs without {SEED_FLAG}, so SGLang ignores sampling_seed: calls with a seed "
            f"are refused on it; restart SGLang with {SEED_FLAG} for reproducible sampling"
        )
    if known.incremental is False:
        caps.warnings.append(
            f"the engine streams cumulatively (no {STREAM_FLAG}): every chunk repeats all ids and "
            "logprobs so far, O(n^2) bytes (about 1.1 GB of JSON for one 8k-token rollout); restart "
            f"SGLang with {STREAM_FLAG}"
        )
    truncation = (
        "calls with top_p, top_k or min_p are refused (--raw-logprobs refuse)"
        if raw_logprobs == "refuse"
        else "they differ from vLLM's processed_logprobs whenever top_p, top_k or min_p truncate"
    )
    caps.warnings.append(
        "SGLang returns temperature-scaled logprobs, not renormalised after top-p/top-k/min-p: "
        f"{truncation}; they are raw if the engine runs with {ORIGINAL_LOGPROB_ENV}=1, which "
        "/server_info does not show: keep that variable unset"
    )
    return caps


async def check(client: SglangEngine, raw_logprobs: str) -> tuple[EngineCapabilities, ServerFacts]:
    """Probe one SGLang engine: its capabilities and the facts each call is checked against."""
    models = await client.models()
    info = await read_server_info(client)
    caps = classify(info, models, client.experts_topk, raw_logprobs)
    return caps, facts(info, raw_logprobs, caps.max_model_len)
