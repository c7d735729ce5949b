"""slime's evaluation through the rollout service: `generate_rollout(..., evaluation=True)`.

slime sets `--eval-function-path` to the rollout function when it is unset, so the drop-in's
`generate_rollout` is called with `evaluation=True` for every eval. slime's own `eval_rollout`
(THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515, `slime/rollout/sglang_rollout.py`) loads each
of `args.eval_datasets` with slime's `Dataset`, copies every prompt `n_samples_per_eval_prompt`
times (sample indexes counting up across the dataset; seed `rollout_seed + j` for copy `j` with
deterministic inference), generates with the dataset's own sampling parameters, scores each sample
with the dataset's `rm_type` (else `--rm-type`), and returns
`RolloutFnEvalOutput(data={name: {"rewards", "truncated", "samples"}})` sorted by index.

Here each dataset is one RolloutStep: a prompt's copies are one group of `n_samples_per_eval_prompt`
(the step gives sample `j` the seed `base + j`, as slime does), every group kept, the reward run by
the service. The prompts come from slime's own `Dataset` (`EVAL_PROMPTS`, replaceable in tests).
Dataset settings the service cannot honour are refused naming them.
"""

from __future__ import annotations

import asyncio
import copy
import types
from collections.abc import Callable
from typing import Any

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.integrations.slime import client_for, translate_sampling_params
from rollout_grpc.integrations.slime_args import OWN_GENERATE
from rollout_grpc.integrations.slime_step import _wire_group, _write_back, reward_of

#: Per dataset config, the slime prompt Samples the eval generates from.
PromptLoader = Callable[[Any, Any], list[Any]]

#: Dataset settings of slime's eval runner the service does not run, with what to do instead.
_REFUSED = {
    "custom_rm_path": "serve the reward over HTTP and set rm_type remote_rm",
    "app_service": "generation through an app server stays with slime's own eval function",
    "message_processor": "per-source processing stays with slime's own eval function",
    "reward_model": "per-source reward models: set rm_type (or rm_type remote_rm) on the dataset",
    "remote_environment": "environments stay with slime's own eval function",
    "min_eval_samples": "early stop stays with slime's own eval function",
    "eval_early_stop_remaining": "early stop stays with slime's own eval function",
    "eval_early_stop_idle_timeout": "early stop stays with slime's own eval function",
}
_CACHE: dict[tuple[Any, ...], list[Any]] = {}


def slime_eval_prompts(args: Any, cfg: Any) -> list[Any]:
    """The prompts of one eval dataset, loaded by slime's own `Dataset` (cached per dataset, as
    slime caches them), with the dataset's overrides of slime's global data settings."""
    from slime.utils.data import Dataset  # type: ignore[import-not-found]
    from slime.utils.processing_utils import load_processor, load_tokenizer  # type: ignore[import-not-found]

    def pick(name: str) -> Any:
        own = getattr(cfg, name, None)
        return own if own is not None else getattr(args, name, None)

    key = (
        *cfg.cache_key,
        args.hf_checkpoint,
        repr(pick("apply_chat_template")),
        repr(pick("multimodal_keys")),
    )
    if key not in _CACHE:
        _CACHE[key] = list(
            Dataset(
                path=cfg.path,
                tokenizer=load_tokenizer(args.hf_checkpoint, trust_remote_code=True),
                processor=load_processor(args.hf_checkpoint, trust_remote_code=True),
                max_length=getattr(args, "eval_max_prompt_len", None),
                prompt_key=cfg.input_key,
                label_key=cfg.label_key,
                multimodal_keys=pick("multimodal_keys"),
                metadata_key=cfg.metadata_key,
                tool_key=cfg.tool_key,
                apply_chat_template=pick("apply_chat_template"),
                apply_chat_template_kwargs=pick("apply_chat_template_kwargs"),
            ).samples
        )
    return _CACHE[key]


#: Where the eval prompts come from (slime's Dataset; tests give their own).
EVAL_PROMPTS: PromptLoader = slime_eval_prompts


def _check_dataset(cfg: Any) -> None:
    for name, instead in _REFUSED.items():
        if getattr(cfg, name, None) is not None:
            raise ValueError(f"eval dataset {cfg.name!r}: {name} is set; {instead}")
    path = getattr(cfg, "custom_generate_function_path", None)
    if path and path != OWN_GENERATE:
        raise ValueError(
            f"eval dataset {cfg.name!r}: custom_generate_function_path {path!r} would be replaced by plain "
            "generation; evaluate it with slime's own eval function (--eval-function-path "
            "slime.rollout.sglang_rollout.generate_rollout with --custom-generate-function-path "
            f"{OWN_GENERATE})"
        )
    if not getattr(cfg, "n_samples_per_eval_prompt", None):
        raise ValueError(f"eval dataset {cfg.name!r}: n_samples_per_eval_prompt is not set")


def eval_sampling_params(args: Any, cfg: Any) -> pb.SamplingParams:
    """The dataset's sampling parameters, with slime's fallbacks to the rollout's."""

    def own(name: str, fallback: Any) -> Any:
        value = getattr(cfg, name, None)
        return value if value is not None else fallback

    params: dict[str, Any] = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_response_len,
        "stop": own("stop", getattr(args, "rollout_stop", None)),
        "stop_token_ids": own("stop_token_ids", getattr(args, "rollout_stop_token_ids", None)),
        "skip_special_tokens": own(
            "skip_special_tokens", getattr(args, "rollout_skip_special_tokens", False)
        ),
        "no_stop_trim": own("no_stop_trim", True),
        "spaces_between_special_tokens": False,
        "repetition_penalty": getattr(cfg, "repetition_penalty", None),
        "min_new_tokens": own("min_new_tokens", getattr(args, "eval_min_new_tokens", None)),
    }
    if getattr(args, "sglang_enable_deterministic_inference", False):
        params["sampling_seed"] = args.rollout_seed  # copy j gets rollout_seed + j
    return translate_sampling_params({k: v for k, v in params.items() if v is not None})


async def _eval_dataset(args: Any, rollout_id: int, number: int, cfg: Any) -> dict[str, dict[str, list[Any]]]:
    n = int(cfg.n_samples_per_eval_prompt)
    rm_type = cfg.rm_type or getattr(args, "rm_type", None)
    reward = reward_of(types.SimpleNamespace(**{**vars(args), "rm_type": rm_type, "group_rm": False}))
    groups: list[list[Any]] = []
    for p, prompt in enumerate(EVAL_PROMPTS(args, cfg)):
        group = []
        for j in range(n):
            sample = copy.deepcopy(prompt)
            sample.index, sample.group_index = p * n + j, p
            sample.metadata = cfg.inject_metadata(getattr(sample, "metadata", None))
            group.append(sample)
        groups.append(group)
    wired = {}
    messages = []
    for group in groups:
        message, sent = _wire_group(group, rm_type)
        wired[message.group_index] = (group, sent)
        messages.append(message)
    timeout = getattr(cfg, "eval_task_timeout", None)
    async for event in client_for(args).rollout_step(
        messages,
        n_samples_per_prompt=n,
        step_id=f"eval-{rollout_id}-{number}",
        params=eval_sampling_params(args, cfg),
        options=pb.GenerateOptions(final_only=True),
        reward=reward,
        filter=pb.FilterSpec(kind=pb.FILTER_KIND_KEEP_ALL),
        timeout=float(timeout) if timeout else None,
    ):
        if event.WhichOneof("event") == "group":
            group, sent = wired[event.group.group_index]
            _write_back(group, sent, event.group)
        elif event.WhichOneof("event") == "summary" and not event.summary.target_reached:
            raise RuntimeError(f"eval dataset {cfg.name!r}: the rollout step stopped: {event.summary.reason}")
    data = sorted((s for g in groups for s in g), key=lambda s: s.index)
    key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
    return {
        cfg.name: {
            "rewards": [s.reward[key] if key else s.reward for s in data],
            "truncated": [s.status.name == "TRUNCATED" for s in data],
            "samples": data,
        }
    }


async def eval_rollout_async(args: Any, rollout_id: int) -> dict[str, dict[str, list[Any]]]:
    """Every eval dataset through the service; slime's `{name: {rewards, truncated, samples}}`."""
    if getattr(args, "group_rm", False):
        raise ValueError("--group-rm: slime's eval does not support group reward models either")
    datasets = list(getattr(args, "eval_datasets", None) or [])
    for cfg in datasets:
        _check_dataset(cfg)  # every dataset before any generates
    results = await asyncio.gather(
        *(_eval_dataset(args, rollout_id, i, cfg) for i, cfg in enumerate(datasets))
    )
    merged: dict[str, dict[str, list[Any]]] = {}
    for result in results:
        merged.update(result)
    return merged


def eval_rollout(args: Any, rollout_id: int) -> Any:
    """The blocking entry (`generate_rollout(..., evaluation=True)`): `RolloutFnEvalOutput` when slime
    is importable, else the dict slime wraps into one."""
    data = asyncio.run(eval_rollout_async(args, rollout_id))
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput  # type: ignore[import-not-found]
    except ImportError:
        return data
    return RolloutFnEvalOutput(data=data)
