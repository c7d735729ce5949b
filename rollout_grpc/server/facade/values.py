"""The value types the doors exchange with the facade, in one place.

A door (the gRPC and OpenAI front doors, the peer and sibling-worker services) imports nothing
below the facade (pyproject's "the doors go down through the facade only" contract): the requests
it builds and the results it maps come from here or from the domain. The types are defined beside
the use case that produces them (a step's spec beside the step runner, an abort's result beside
fleet control) and named here, so a door's imports say which values it may hold and a use case
can change its internals without a door noticing.
"""

from __future__ import annotations

from rollout_grpc.server.envs.api import EpisodeConfig
from rollout_grpc.server.rewards.api import RemoteFilterConfig, RewardConfig, RewardKind
from rollout_grpc.server.rollout.control import (
    AbortResult,
    AbortScope,
    EngineStatus,
    FleetResult,
    ForwardedAbort,
)
from rollout_grpc.server.rollout.render import Part, Rendered
from rollout_grpc.server.rollout.step.events import GroupEnded, Progress, SampleEnded, StepEvent, Summary
from rollout_grpc.server.rollout.step.policy import Admission as StepAdmission
from rollout_grpc.server.rollout.step.policy import OverSampling
from rollout_grpc.server.rollout.step.spec import (
    MAX_GROUPS,
    FilterKind,
    Leftovers,
    OnRewardFailure,
    OnStale,
    Outcome,
    PromptGroup,
    RewardScope,
    StepCounts,
    StepSample,
    StepSpec,
)
from rollout_grpc.server.rollout.weights import (
    CheckpointSource,
    DistributedSource,
    MemoryRelease,
    TensorSpec,
    TransferGroup,
    TransferPlan,
    WeightUpdate,
    WeightUpdateResult,
)

__all__ = [
    "MAX_GROUPS",
    "AbortResult",
    "AbortScope",
    "CheckpointSource",
    "DistributedSource",
    "EngineStatus",
    "EpisodeConfig",
    "FilterKind",
    "FleetResult",
    "ForwardedAbort",
    "GroupEnded",
    "Leftovers",
    "MemoryRelease",
    "OnRewardFailure",
    "OnStale",
    "Outcome",
    "OverSampling",
    "Part",
    "Progress",
    "PromptGroup",
    "RemoteFilterConfig",
    "Rendered",
    "RewardConfig",
    "RewardKind",
    "RewardScope",
    "SampleEnded",
    "StepAdmission",
    "StepCounts",
    "StepEvent",
    "StepSample",
    "StepSpec",
    "Summary",
    "TensorSpec",
    "TransferGroup",
    "TransferPlan",
    "WeightUpdate",
    "WeightUpdateResult",
]
