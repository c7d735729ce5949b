"""What a RolloutStep asks for, in domain terms, and the checks made before anything generates.

Every policy is explicit and optional: no reward (samples unscored), keep-all filter, no
over-sampling (groups in flight = target), leftovers returned, no staleness bound. Bad input is
refused up front with INVALID_ARGUMENT naming the field (docs/rollout-step.md "Bad input").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.model import GenerateOptions, Sample, SamplingParams, Status
from rollout_grpc.server.envs.api import EpisodeConfig
from rollout_grpc.server.rewards.api import RemoteFilterConfig, RewardConfig
from rollout_grpc.server.rollout.step.episode_state import EpisodeState
from rollout_grpc.server.rollout.step.policy import Admission, OverSampling

#: Most samples per prompt one step may ask for (a group is pinned to one engine: a huge group
#: would serialise on it).
MAX_SAMPLES_PER_PROMPT = 64
#: Most prompt groups one step may carry.
MAX_GROUPS = 100_000
#: The longest prompt (and partial sample) in tokens a step takes when no engine reports its
#: `max_model_len` (with one, that is the bound): each started sample holds its own token list.
UNKNOWN_CONTEXT_TOKENS = 1 << 18


class RewardScope(enum.Enum):
    """Score each sample when it ends, or the whole group in one call (slime's `--group-rm`)."""

    SAMPLE = "sample"
    GROUP = "group"


class OnRewardFailure(enum.Enum):
    """What a failed reward does to its group."""

    FAIL_GROUP = "fail_group"
    DROP_GROUP = "drop_group"
    KEEP_UNSCORED = "keep_unscored"


class FilterKind(enum.Enum):
    """The built-in dynamic filters."""

    KEEP_ALL = "keep_all"
    REWARD_NONZERO_STD = "reward_nonzero_std"
    #: An operator-installed filter plugin (`StepSpec.filter_plugin`; plugins.py).
    PLUGIN = "plugin"
    #: A remote filter over HTTP (`StepSpec.remote_filter`; rewards/remote_filter.py).
    REMOTE = "remote"


class Leftovers(enum.Enum):
    """Groups in flight at the target: returned ABORTED, or buffered for the caller's next step."""

    RETURN = "return"
    BUFFER = "buffer"


class OnStale(enum.Enum):
    """A group with a sample over `max_staleness`: dropped, or generated again once."""

    DROP = "drop"
    REGENERATE = "regenerate"


class Outcome(enum.Enum):
    """How a group ended (the proto's `GroupOutcome`)."""

    ACCEPTED = "accepted"
    FILTERED = "filtered"
    FAILED = "failed"
    STALE = "stale"
    ABORTED = "aborted"
    BUFFERED = "buffered"


@dataclass(slots=True)
class StepSample:
    """One sample of a step: the generated part (`sample`) and what the step adds to it.

    `origin` is the transport's own message of the sample (its metadata and other fields the
    domain never reads are copied back from it); the step never looks inside.
    """

    sample: Sample
    index: int
    origin: object = None
    reward: float | None = None
    reward_detail: dict[str, object] | None = None
    reward_failure: str = ""
    start_step_id: str = ""
    #: Response tokens generated for this sample by the current step (metrics, log line).
    new_tokens: int = 0
    #: Where the sample's episode is (steps with an `episode`; docs/episodes.md), else None.
    episode: EpisodeState | None = None


@dataclass(slots=True)
class PromptGroup:
    """One prompt of the step (or a group continued from an earlier step)."""

    group_index: int
    prompt: Sample
    origin: object = None
    prompt_index: int = 0
    label: str = ""
    #: Samples to continue instead of fresh copies of the prompt (n of them, or empty).
    partial: list[StepSample] = field(default_factory=list)
    #: This group's own sampling parameters instead of the step's (None: the step's).
    params: SamplingParams | None = None


@dataclass(slots=True)
class StepSpec:
    """One RolloutStep request."""

    step_id: str
    groups: list[PromptGroup]
    n_samples_per_prompt: int
    params: SamplingParams
    options: GenerateOptions
    target_groups: int = 0
    max_groups_in_flight: int = 0
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_scope: RewardScope = RewardScope.SAMPLE
    on_reward_failure: OnRewardFailure = OnRewardFailure.FAIL_GROUP
    filter: FilterKind = FilterKind.KEEP_ALL
    epsilon: float = 0.0
    leftovers: Leftovers = Leftovers.RETURN
    continue_buffered: bool = False
    max_staleness: int | None = None
    on_stale: OnStale = OnStale.DROP
    stream_samples: bool = False
    #: How groups beyond the target start (slime's rule by default; policy.py).
    over_sampling: OverSampling = OverSampling.SLIME_BATCHES
    #: SLIME_BATCHES: groups per batch (0: the target).
    over_sampling_batch_size: int = 0
    #: AReaL-style admission by the trainer's consumed version (None: none).
    admission: Admission | None = None
    #: FilterKind.PLUGIN: the filter plugin's name.
    filter_plugin: str = ""
    #: FilterKind.REMOTE: the remote filter.
    remote_filter: RemoteFilterConfig | None = None
    #: Each sample is a multi-turn episode driven by this environment server (None: one turn).
    episode: EpisodeConfig | None = None
    #: The caller's name for its buffer (an anonymous caller must give one to buffer; buffer.py).
    buffer_name: str = ""


@dataclass(frozen=True, slots=True)
class StepCounts:
    """The counts of a step request, read from the wire message before anything is converted: a
    step of 100,000 groups was converted (2-4 s of the event loop) before it was refused."""

    n_samples_per_prompt: int
    groups: int
    target_groups: int = 0
    max_groups_in_flight: int = 0
    continue_buffered: bool = False

    @classmethod
    def of(cls, spec: StepSpec) -> StepCounts:
        return cls(
            spec.n_samples_per_prompt,
            len(spec.groups),
            spec.target_groups,
            spec.max_groups_in_flight,
            spec.continue_buffered,
        )


def check(spec: StepSpec, buffered: int) -> None:
    """Refuse a step that cannot run, naming the field (before anything generates).

    `buffered` is how many groups the caller has buffered (they count toward the supply when
    `continue_buffered`).
    """
    check_counts(StepCounts.of(spec), buffered)
    _check_bounds(spec, spec.n_samples_per_prompt)


def check_counts(counts: StepCounts, buffered: int) -> None:
    """The checks that need only counts: samples per prompt, groups, target and supply."""
    n = counts.n_samples_per_prompt
    if not 1 <= n <= MAX_SAMPLES_PER_PROMPT:
        raise InvalidArgument("n_samples_per_prompt", f"must be 1 to {MAX_SAMPLES_PER_PROMPT}, got {n}")
    supply = counts.groups + (buffered if counts.continue_buffered else 0)
    if counts.groups > MAX_GROUPS:
        raise InvalidArgument("groups", f"at most {MAX_GROUPS} groups per step, got {counts.groups}")
    if supply == 0:
        raise InvalidArgument("groups", "must hold at least one prompt group (none given, none buffered)")
    if counts.target_groups < 0:
        raise InvalidArgument("target_groups", f"must be non-negative, got {counts.target_groups}")
    if counts.target_groups > supply:
        raise InvalidArgument(
            "target_groups", f"asks for {counts.target_groups} groups but only {supply} are given or buffered"
        )
    if counts.max_groups_in_flight < 0:
        raise InvalidArgument(
            "max_groups_in_flight", f"must be non-negative, got {counts.max_groups_in_flight}"
        )


def _check_bounds(spec: StepSpec, n: int) -> None:
    """Non-negative bounds, a seed that does not overflow, well-formed groups."""
    if spec.max_staleness is not None and spec.max_staleness < 0:
        raise InvalidArgument("max_staleness", f"must be non-negative, got {spec.max_staleness}")
    if spec.over_sampling_batch_size < 0:
        raise InvalidArgument(
            "over_sampling_batch_size", f"must be non-negative, got {spec.over_sampling_batch_size}"
        )
    if spec.admission is not None:
        if spec.admission.max_head_offpolicyness < 0:
            raise InvalidArgument(
                "max_head_offpolicyness",
                f"must be non-negative, got {spec.admission.max_head_offpolicyness}",
            )
        if not spec.admission.consumed_version:
            raise InvalidArgument(
                "consumed_weight_version",
                "is required with max_head_offpolicyness (the version the trainer has consumed)",
            )
    if spec.epsilon < 0:
        raise InvalidArgument("filter.epsilon", f"must be non-negative, got {spec.epsilon}")
    if spec.params.seed is not None and spec.params.seed + n - 1 >= 2**63:
        raise InvalidArgument("sampling_params.seed", "base seed + n_samples_per_prompt overflows")
    _check_groups(spec.groups, n)


def _check_groups(groups: list[PromptGroup], n: int) -> None:
    """Each group: a unique index, a prompt, and either no partial samples or exactly n."""
    seen: set[int] = set()
    for i, group in enumerate(groups):
        if group.group_index in seen:
            raise InvalidArgument(f"groups[{i}].group_index", f"group {group.group_index} appears twice")
        seen.add(group.group_index)
        if not group.prompt.token_count and not group.prompt.prompt:
            raise InvalidArgument(f"groups[{i}].prompt", "needs prompt token ids or prompt text")
        if group.partial and len(group.partial) != n:
            raise InvalidArgument(
                f"groups[{i}].partial",
                f"must hold n_samples_per_prompt={n} samples, got {len(group.partial)}",
            )
        if not group.partial and group.prompt.status not in (Status.PENDING, Status.UNSPECIFIED):
            raise InvalidArgument(f"groups[{i}].prompt.status", "a fresh prompt must be PENDING (or unset)")
