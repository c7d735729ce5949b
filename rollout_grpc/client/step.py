"""Building RolloutStep requests and following their streams (both clients share it).

A step's stream is `RolloutStepResponse` events: `group` results (accepted ones to train on;
dropped, aborted and buffered ones with their reason), `progress` counters, optional `sample`
events, and last one `summary`. `StepProgressBar` turns the progress events into a tqdm bar
(tqdm is imported only when a bar is asked for: it is not a client dependency).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.samples import OptionsLike, ParamsLike, SampleLike, to_options, to_params, to_sample

#: A prompt group: the message, or (prompt sample, group index[, label]).
GroupLike = pb.PromptGroup | tuple[SampleLike, int] | tuple[SampleLike, int, str]
RewardLike = pb.RewardSpec | Mapping[str, Any] | None
FilterLike = pb.FilterSpec | Mapping[str, Any] | None
#: An episode environment (docs/episodes.md): the message, or a dict such as {"url": ..., "max_turns": 4}.
EpisodeLike = pb.EpisodeSpec | Mapping[str, Any] | None

_LEFTOVERS = {"return": pb.LEFTOVER_POLICY_RETURN, "buffer": pb.LEFTOVER_POLICY_BUFFER}
_ON_STALE = {"drop": pb.STALENESS_POLICY_DROP, "regenerate": pb.STALENESS_POLICY_REGENERATE}
_OVER_SAMPLING = {
    "slime_batches": pb.OVER_SAMPLING_POLICY_SLIME_BATCHES,
    "keep_in_flight": pb.OVER_SAMPLING_POLICY_KEEP_IN_FLIGHT,
}


def _group(value: GroupLike) -> pb.PromptGroup:
    if isinstance(value, pb.PromptGroup):
        return value
    sample, index, *rest = value
    return pb.PromptGroup(prompt=to_sample(sample), group_index=index, label=rest[0] if rest else "")


def prompt_group(
    sample: SampleLike, group_index: int, label: str = "", *, params: ParamsLike = None
) -> pb.PromptGroup:
    """A prompt group, with its own sampling parameters when `params` is given (slime's per-sample
    `sampling_params`: eval groups beside train groups in one step); None: the step's."""
    group = pb.PromptGroup(prompt=to_sample(sample), group_index=group_index, label=label)
    if params is not None:
        group.sampling_params.CopyFrom(to_params(params))
    return group


def _message(value: Any, kind: Any) -> Any:
    """A message from itself or from a dict in the proto's JSON names (enum values by name)."""
    if value is None:
        return kind()
    if isinstance(value, kind):
        return value
    return json_format.ParseDict(dict(value), kind())


#: This trainer process's partial-rollout buffer name, when a step names none: random, so two
#: anonymous trainers never share (or guess) a buffer, and stable for the life of the process, so
#: its next step continues what its last step buffered on any replica. A trainer that restarts and
#: must continue its old buffer passes its own stable `buffer_name` (kept secret without auth).
DEFAULT_BUFFER_NAME = f"trainer-{uuid.uuid4().hex}"


def step_request(
    groups: Sequence[GroupLike],
    *,
    n_samples_per_prompt: int,
    step_id: str | None = None,
    target_groups: int = 0,
    max_groups_in_flight: int = 0,
    params: ParamsLike = None,
    options: OptionsLike = None,
    reward: RewardLike = None,
    filter: FilterLike = None,
    leftovers: str = "return",
    continue_buffered: bool = False,
    max_staleness: int | None = None,
    on_stale: str = "drop",
    stream_samples: bool = False,
    over_sampling: str = "slime_batches",
    over_sampling_batch_size: int = 0,
    consumed_weight_version: str = "",
    max_head_offpolicyness: int | None = None,
    episode: EpisodeLike = None,
    buffer_name: str | None = None,
) -> pb.RolloutStepRequest:
    """A RolloutStepRequest (a fresh step id when none is given; this process's
    `DEFAULT_BUFFER_NAME` when no `buffer_name` is)."""
    if leftovers not in _LEFTOVERS:
        raise ValueError(f"leftovers must be one of {sorted(_LEFTOVERS)}, got {leftovers!r}")
    if on_stale not in _ON_STALE:
        raise ValueError(f"on_stale must be one of {sorted(_ON_STALE)}, got {on_stale!r}")
    if over_sampling not in _OVER_SAMPLING:
        raise ValueError(f"over_sampling must be one of {sorted(_OVER_SAMPLING)}, got {over_sampling!r}")
    request = pb.RolloutStepRequest(
        step_id=step_id or f"step-{uuid.uuid4().hex[:12]}",
        groups=[_group(g) for g in groups],
        n_samples_per_prompt=n_samples_per_prompt,
        target_groups=target_groups,
        max_groups_in_flight=max_groups_in_flight,
        sampling_params=to_params(params),
        options=to_options(options),
        reward=_message(reward, pb.RewardSpec),
        filter=_message(filter, pb.FilterSpec),
        leftovers=_LEFTOVERS[leftovers],
        continue_buffered=continue_buffered,
        on_stale=_ON_STALE[on_stale],
        stream_samples=stream_samples,
        over_sampling=_OVER_SAMPLING[over_sampling],
        over_sampling_batch_size=over_sampling_batch_size,
        consumed_weight_version=consumed_weight_version,
        buffer_name=DEFAULT_BUFFER_NAME if buffer_name is None else buffer_name,
    )
    if max_staleness is not None:
        request.max_staleness = max_staleness
    if max_head_offpolicyness is not None:
        request.max_head_offpolicyness = max_head_offpolicyness
    if episode is not None:
        request.episode.CopyFrom(_message(episode, pb.EpisodeSpec))
    return request


class StepProgressBar:
    """A tqdm bar of accepted groups out of the target, with the other counters as its postfix."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError("progress_bar=True needs tqdm: pip install tqdm") from None
        self._bar: Any = tqdm(total=total or None, unit="group", desc="rollout step")

    def update(self, event: pb.RolloutStepResponse) -> None:
        kind = event.WhichOneof("event")
        progress = (
            event.progress if kind == "progress" else event.summary.progress if kind == "summary" else None
        )
        if progress is None:
            return
        self._bar.n = progress.accepted
        self._bar.set_postfix(
            generated=progress.generated,
            scored=progress.scored,
            dropped=sum(progress.dropped.values()),
            in_flight=progress.in_flight,
            refresh=False,
        )
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
