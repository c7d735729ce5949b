"""The slime settings the RolloutStep drop-in honours, and the refusal of every one it cannot.

A slime user who sets a flag expects it to act. The drop-in either does what the flag asks (the
reward types, the filter, partial rollout, the post-rollout hooks, ...) or refuses the rollout at
its start with a ValueError naming the flag and what to do instead: it never runs a rollout that
silently differs from the one slime would run. The settings were read from THUDM/slime
624b824a898ab0ec1fcb4d373004c7f3852bf515 (`slime/utils/arguments.py`, `slime/rollout/sglang_rollout.py`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

#: This project's per-sample slime hook: generating with it is what the step does itself.
OWN_GENERATE = "rollout_grpc.integrations.slime.generate"
#: slime's built-in nonzero-std filter (the only dynamic filter the service runs itself).
NONZERO_STD_FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"

_CUSTOM_GENERATE = (
    "{where} {path!r}: the rollout step generates one plain completion per sample, so a custom "
    "generate function (multi-turn, tools, agents) would be replaced, not run. Use slime's own "
    "rollout function with --custom-generate-function-path " + OWN_GENERATE + " (every engine call "
    "of your function goes through the service), or drive the episode through the agentic front door"
)


def load_function(path: str) -> Callable[..., Any]:
    """`module.attribute` imported (slime's `load_function`), with an error naming the path."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"{path!r} is not a dotted path `module.function`")
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {path!r}: {exc}") from exc


def _refusals(args: Any) -> list[str]:
    refusals = []
    path = getattr(args, "custom_generate_function_path", None)
    if path and path != OWN_GENERATE:
        refusals.append(_CUSTOM_GENERATE.format(where="--custom-generate-function-path", path=path))
    top_p = getattr(args, "rollout_top_p", 1.0)
    if top_p is not None and float(top_p) != 1.0:
        refusals.append(
            f"--rollout-top-p {top_p}: slime's training then needs each sample's top-p token ids "
            "(rollout_top_p_token_ids, from slime's patched SGLang), which vLLM does not return; "
            "run with --rollout-top-p 1.0"
        )
    if getattr(args, "rollout_sample_hook_path", None):
        refusals.append(
            "--rollout-sample-hook-path: slime runs these hooks on each sample between generation and "
            "its reward, which happens inside the service here; move the hook's work into the reward "
            "model (--rm-type remote_rm) or use slime's own rollout function"
        )
    if getattr(args, "rollout_global_dataset", True) is False:
        refusals.append(
            "--rollout-global-dataset is off: slime's rollout function needs the global data source "
            "(it asserts it too); drop --disable-rollout-global-dataset"
        )
    if getattr(args, "custom_rm_path", None):
        refusals.append(
            "--custom-rm-path runs trainer code the service cannot call: serve the reward over HTTP and "
            "pass --rm-type remote_rm --rm-url URL, or use slime's own rollout function"
        )
    filter_path = getattr(args, "dynamic_sampling_filter_path", None)
    if filter_path and filter_path != NONZERO_STD_FILTER:
        refusals.append(
            f"--dynamic-sampling-filter-path {filter_path!r}: the service runs {NONZERO_STD_FILTER} only "
            "(a filter with keep_when_insufficient, or your own, would be replaced); use slime's own "
            "rollout function for it"
        )
    return refusals


def check_args(args: Any) -> None:
    """Refuse a rollout whose slime settings the drop-in would otherwise ignore (every reason)."""
    refusals = _refusals(args)
    for flag in ("rollout_sample_filter_path", "rollout_all_samples_process_path"):
        path = getattr(args, flag, None)
        if path:
            load_function(path)  # a typo fails now, not after the rollout's generation
    if refusals:
        raise ValueError(
            "the rollout_grpc slime drop-in cannot run these settings:\n* " + "\n* ".join(refusals)
        )


def check_sample(sample: Any, rm_type: str | None) -> None:
    """Refuse a sample that asks for its own reward or generate function (slime honours
    `metadata["rm_type"]`, `custom_rm_path` and `generate_function_path` per sample)."""
    metadata = sample.metadata if isinstance(getattr(sample, "metadata", None), dict) else {}
    own = (metadata.get("rm_type") or "").strip()
    if own and own != (rm_type or "").strip():
        raise ValueError(
            f'sample {sample.index}: metadata["rm_type"] is {own!r} but the rollout scores with '
            f"--rm-type {rm_type!r}; one step has one reward: split the data by reward type, or make "
            "--rm-type match"
        )
    if getattr(sample, "custom_rm_path", None):
        raise ValueError(
            f"sample {sample.index}: custom_rm_path {sample.custom_rm_path!r} runs trainer code the "
            "service cannot call; serve it over HTTP (rm_type remote_rm)"
        )
    path = getattr(sample, "generate_function_path", None)
    if path and path != OWN_GENERATE:
        raise ValueError(
            _CUSTOM_GENERATE.format(where=f"sample {sample.index}: generate_function_path", path=path)
        )
