"""slime drop-in for the whole rollout, on RolloutStep.

`--rollout-function-path rollout_grpc.integrations.slime_step.generate_rollout`.

slime's default rollout function (`sglang_rollout.generate_rollout`) runs the loop of
docs/rollout-semantics.md §3 in the trainer: over-sampling batches from the data source, groups of
`n_samples_per_prompt`, rewards, the dynamic filter, abort of the rest, partial rollout. This one
hands the loop to the rollout service's `RolloutStep` and keeps slime's contract:

* groups come from `data_source.get_samples(over_sampling_batch_size)` (the buffer first), and
  ABORTED groups go back with `data_source.add_samples` under `--partial-rollout` (with
  `metadata["start_rollout_id"]` set like slime's abort), else they are dropped as slime does;
* the slime `Sample` objects stay the source of truth: results are written back into them
  (`slime.apply_result`), rewards into `sample.reward` (the whole JSON object when the reward
  model returned one, as slime's remote_rm does);
* the return value is `RolloutFnTrainOutput(samples, metrics)` when slime is importable, else the
  list of groups, sorted by the first sample's index; metrics count drops by reason.

Every slime setting the drop-in sees is honoured or refused when the rollout starts, with a
ValueError naming it and what to do (`check_args`; docs/slime.md has the table). Honoured:
`--rm-type remote_rm` (`--rm-url`, `--reward-key`), `math`, `dapo`, `deepscaler`, `f1`, `gpqa`
(slime's verdicts), `--group-rm`, `--dynamic-sampling-filter-path` unset or
`check_reward_nonzero_std`, `--over-sampling-batch-size`, the `--rollout-*` sampling arguments,
`--partial-rollout`, `--mask-offpolicy-in-partial-rollout`, deterministic seeds (`--rollout-seed`),
`--rollout-sample-filter-path` and `--rollout-all-samples-process-path` (trainer code, run here as
slime runs it), `--custom-generate-function-path` when it is this project's own `slime.generate`.
Evaluation (`evaluation=True`, slime's default when `--eval-function-path` is unset) runs slime's
eval datasets through the service (`slime_eval.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.integrations import slime_args
from rollout_grpc.integrations.slime import apply_result, client_for, to_wire, translate_sampling_params
from rollout_grpc.integrations.slime_args import check_args, check_sample, load_function

#: slime's built-in nonzero-std filter (the only dynamic filter the service runs itself).
NONZERO_STD_FILTER = slime_args.NONZERO_STD_FILTER

#: slime's threshold in `check_reward_nonzero_std`.
NONZERO_STD_EPSILON = 1e-6


def sampling_params_of(args: Any) -> pb.SamplingParams:
    """The sampling parameters slime builds from its `--rollout-*` arguments."""
    params: dict[str, Any] = {
        "temperature": getattr(args, "rollout_temperature", 1.0),
        "top_p": getattr(args, "rollout_top_p", 1.0),
        "top_k": getattr(args, "rollout_top_k", -1),
        "max_new_tokens": args.rollout_max_response_len,
        "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", False),
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if getattr(args, "rollout_stop", None):
        params["stop"] = list(args.rollout_stop)
    if getattr(args, "rollout_stop_token_ids", None):
        params["stop_token_ids"] = list(args.rollout_stop_token_ids)
    if getattr(args, "sglang_enable_deterministic_inference", False):
        params["sampling_seed"] = args.rollout_seed  # the service adds i for sample i of a group
    return translate_sampling_params(params)


#: slime's rule `--rm-type`s and the service's kinds that give the same verdicts.
RULE_KINDS = {
    "math": pb.REWARD_KIND_SLIME_MATH,
    "dapo": pb.REWARD_KIND_DAPO,
    "deepscaler": pb.REWARD_KIND_DEEPSCALER,
    "f1": pb.REWARD_KIND_F1,
    "gpqa": pb.REWARD_KIND_GPQA,
}


def reward_of(args: Any) -> pb.RewardSpec:
    """slime's reward arguments as a RewardSpec (ValueError for a reward the service cannot run)."""
    scope = pb.REWARD_SCOPE_GROUP if getattr(args, "group_rm", False) else pb.REWARD_SCOPE_SAMPLE
    rm_type = (getattr(args, "rm_type", None) or "").strip()
    if getattr(args, "custom_rm_path", None):
        raise ValueError(
            "--custom-rm-path runs trainer code the service cannot call: use slime's own rollout "
            "function, or serve the reward over HTTP and pass --rm-type remote_rm --rm-url URL"
        )
    if rm_type == "remote_rm":
        return pb.RewardSpec(
            kind=pb.REWARD_KIND_REMOTE,
            url=args.rm_url,
            reward_key=getattr(args, "reward_key", None) or "reward",
            scope=scope,
        )
    if rm_type in RULE_KINDS:
        return pb.RewardSpec(kind=RULE_KINDS[rm_type], scope=scope)
    runs = ", ".join(["remote_rm", *RULE_KINDS])
    raise ValueError(
        f"--rm-type {rm_type!r}: the service runs {runs}; for another reward serve it over HTTP "
        "(--rm-type remote_rm --rm-url URL) or use slime's own rollout function"
    )


def filter_of(args: Any) -> pb.FilterSpec:
    """slime's dynamic filter as a FilterSpec (ValueError for a custom filter)."""
    path = getattr(args, "dynamic_sampling_filter_path", None)
    if not path:
        return pb.FilterSpec(kind=pb.FILTER_KIND_KEEP_ALL)
    if path == NONZERO_STD_FILTER:
        return pb.FilterSpec(kind=pb.FILTER_KIND_REWARD_NONZERO_STD, epsilon=NONZERO_STD_EPSILON)
    raise ValueError(f"--dynamic-sampling-filter-path {path!r}: the service runs {NONZERO_STD_FILTER} only")


def _wire_group(group: Sequence[Any], rm_type: str | None = None) -> tuple[pb.PromptGroup, list[pb.Sample]]:
    """A slime group as a PromptGroup: a fresh prompt, or its samples to continue. A sample asking
    for what the step would not do (its own reward type or generate function) is refused."""
    for sample in group:
        check_sample(sample, rm_type)
    wires = [to_wire(s) for s in group]
    for sample, wire in zip(group, wires, strict=True):
        if isinstance(sample.prompt, str) and sample.prompt:
            wire.prompt = sample.prompt  # the reward model reads it (ids, when set, are what generates)
    first = wires[0]
    prompt = pb.Sample(index=first.index, group_index=first.group_index, session_id=first.session_id)
    prompt.tokens.extend(first.tokens[: len(first.tokens) - first.response_length])
    if first.HasField("prompt"):
        prompt.prompt = first.prompt
    message = pb.PromptGroup(prompt=prompt, group_index=first.group_index, label=str(group[0].label or ""))
    if any(s.status == pb.SAMPLE_STATUS_ABORTED or s.response_length for s in wires):
        message.partial.extend(wires)
    return message, wires


def _write_back(group: Sequence[Any], sent: Sequence[pb.Sample], result: pb.GroupResult) -> None:
    """Write a group's results into its slime Samples (matched by index), rewards included."""
    by_index = {s.index: s for s in result.samples}
    for sample, wire in zip(group, sent, strict=True):
        out = by_index.get(wire.index)
        if out is None:
            continue
        apply_result(sample, out, wire)
        if out.HasField("reward_detail"):
            sample.reward = json_format.MessageToDict(out.reward_detail)
        elif out.HasField("reward"):
            sample.reward = out.reward


class _Rollout:
    """One slime rollout: rounds of RolloutStep until `rollout_batch_size` groups are accepted."""

    def __init__(self, args: Any, rollout_id: int, data_source: Any) -> None:
        self.args = args
        self.rollout_id = rollout_id
        self.data_source = data_source
        self.target = int(args.rollout_batch_size)
        self.partial = bool(getattr(args, "partial_rollout", False))
        self.accepted: list[list[Any]] = []
        self.leftovers: list[list[Any]] = []
        #: Every group that came back generated, accepted or not (slime's `all_samples`).
        self.all_groups: list[list[Any]] = []
        self.metrics: dict[str, int] = {}
        #: Why the last round ended short of its target, when that is not a lack of prompts.
        self.stopped = ""

    def _options(self) -> pb.GenerateOptions:
        args = self.args
        return pb.GenerateOptions(
            final_only=True,
            mask_offpolicy=self.partial and bool(getattr(args, "mask_offpolicy_in_partial_rollout", False)),
            return_routed_experts=bool(getattr(args, "use_rollout_routing_replay", False)),
        )

    async def round(self, groups: Sequence[Sequence[Any]]) -> None:
        """One RolloutStep over `groups` (an over-sampling batch of the data source)."""
        wired: dict[int, tuple[Sequence[Any], list[pb.Sample]]] = {}
        messages = []
        for group in groups:
            message, sent = _wire_group(group, getattr(self.args, "rm_type", None))
            wired[message.group_index] = (group, sent)
            messages.append(message)
        args = self.args
        async for event in client_for(args).rollout_step(
            messages,
            n_samples_per_prompt=int(args.n_samples_per_prompt),
            step_id=f"rollout-{self.rollout_id}-{len(self.accepted)}",
            target_groups=min(self.target - len(self.accepted), len(messages)),
            # slime submits a whole over-sampling batch at once: one batch of every group given.
            over_sampling="slime_batches",
            over_sampling_batch_size=len(messages),
            params=sampling_params_of(args),
            options=self._options(),
            reward=reward_of(args),
            filter=filter_of(args),
        ):
            kind = event.WhichOneof("event")
            if kind == "group":
                group, sent = wired[event.group.group_index]
                self._group(group, sent, event.group)
            elif kind == "summary":
                if event.summary.unstarted_group_indexes:
                    # Groups never started go back untouched: the next round (or rollout) takes them.
                    self.data_source.add_samples(
                        [list(wired[i][0]) for i in event.summary.unstarted_group_indexes]
                    )
                if not event.summary.target_reached and event.summary.reason != "no prompt groups left":
                    self.stopped = event.summary.reason

    def _group(self, group: Sequence[Any], sent: list[pb.Sample], result: pb.GroupResult) -> None:
        _write_back(group, sent, result)
        if result.outcome not in (pb.GROUP_OUTCOME_ABORTED, pb.GROUP_OUTCOME_BUFFERED):
            self.all_groups.append(list(group))
        if result.outcome == pb.GROUP_OUTCOME_ACCEPTED:
            self.accepted.append(list(group))
        elif result.outcome == pb.GROUP_OUTCOME_ABORTED:
            self.leftovers.append(list(group))
            return
        else:
            outcome = pb.GroupOutcome.Name(result.outcome).removeprefix("GROUP_OUTCOME_").lower()
            key = f"rollout/dynamic_filter/drop_{outcome}"
            self.metrics[key] = self.metrics.get(key, 0) + 1

    def hand_back_leftovers(self) -> None:
        """Partial rollout: aborted groups go to the data source's buffer (slime's abort)."""
        if not (self.partial and self.leftovers):
            return
        for group in self.leftovers:
            for sample in group:
                if sample.response and "start_rollout_id" not in sample.metadata:
                    sample.metadata["start_rollout_id"] = self.rollout_id
        self.data_source.add_samples(self.leftovers)


async def generate_rollout_async(
    args: Any, rollout_id: int, data_source: Any
) -> tuple[list[list[Any]], dict[str, int]]:
    """The rollout of one step: `rollout_batch_size` accepted groups, and the drop counts."""
    check_args(args)
    rollout = _Rollout(args, rollout_id, data_source)
    batch = int(getattr(args, "over_sampling_batch_size", None) or rollout.target)
    while len(rollout.accepted) < rollout.target:
        groups = data_source.get_samples(batch)
        if not groups:
            raise ValueError("the data source returned no prompt groups")
        await rollout.round(groups)
        if rollout.stopped:
            # A failed reward model (or an abort) is not hidden behind more rounds.
            rollout.hand_back_leftovers()
            raise RuntimeError(f"rollout {rollout_id}: the rollout step stopped: {rollout.stopped}")
    rollout.hand_back_leftovers()
    rollout.accepted.sort(key=lambda g: g[0].index)
    _after_rollout(args, rollout, data_source)
    return rollout.accepted, rollout.metrics


def _after_rollout(args: Any, rollout: _Rollout, data_source: Any) -> None:
    """slime's post-rollout hooks, called as slime calls them: `--rollout-sample-filter-path` on the
    kept groups, `--rollout-all-samples-process-path` on every group generated (kept or dropped)."""
    path = getattr(args, "rollout_sample_filter_path", None)
    if path:
        load_function(path)(args, rollout.accepted)
    path = getattr(args, "rollout_all_samples_process_path", None)
    if path:
        every = sorted(rollout.all_groups, key=lambda g: g[0].index)
        load_function(path)(args, every, data_source)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's `--rollout-function-path` entry (blocking, like slime's own)."""
    if evaluation:
        from rollout_grpc.integrations import slime_eval

        return slime_eval.eval_rollout(args, rollout_id)
    groups, metrics = asyncio.run(generate_rollout_async(args, rollout_id, data_source))
    try:
        from slime.rollout.base_types import RolloutFnTrainOutput  # type: ignore[import-not-found]
    except ImportError:
        return groups
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)
