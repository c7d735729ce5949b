"""The values of a weight update and the checks of their fields, made before any engine is touched.

Kept apart from the steps that run an update (`updates.py`) so that the facade, the settings and
the tests can name the request and result types and the version rule without the machinery.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument
from rollout_grpc.server.engines.api import MEMORY_TAGS, EngineError, TensorSpec, TransferGroup, WeightAction
from rollout_grpc.server.engines.pool import EngineHandle
from rollout_grpc.server.rollout.checkpoint import CheckpointSummary

#: The fleet lease every weight update and memory release/resume holds while it runs.
WEIGHTS_LEASE = "weights"
#: Seconds the lease lives after its last renewal (`--weights-lease-ttl`).
DEFAULT_LEASE_TTL_S = 30.0

VERSION_FIELD = "weight_version"
#: Longest accepted version label (it is copied into every sample's weight spans).
MAX_VERSION_CHARS = 256
#: Seconds a checkpoint load may take on one engine (the operator's `--weights-load-timeout`).
DEFAULT_LOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class CheckpointSource:
    """Load the checkpoint directory `path`, which every engine (and this replica) can read."""

    path: str


@dataclass(frozen=True, slots=True)
class DistributedSource:
    """Receive the tensors the trainer broadcasts in `group` (planned by `plan_transfer`)."""

    group: TransferGroup
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The distributed transfer's ranks: the trainer's first, then each engine's block."""

    world_size: int
    #: (engine URL, rank offset, ranks), in rank order.
    engines: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class Loader:
    """How one update puts weights on an engine: the route named in messages, the call, and whether
    one engine may go first (a broadcast needs every rank at once)."""

    action: WeightAction
    load: Callable[[EngineHandle], Awaitable[None]]
    staged: bool


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """One fleet-wide weight update, in domain terms."""

    source: CheckpointSource | DistributedSource
    #: The label later tokens carry (`Sample.weight_versions`).
    weight_version: str
    #: How in-flight generations are treated while the engines load: abort, wait or keep.
    pause_mode: str
    #: Load on every engine at once instead of on one engine first.
    all_at_once: bool = False


@dataclass(slots=True)
class EngineOutcome:
    """What the update did on one engine: `updated` (loaded and labelled) or `error` says why not."""

    url: str
    updated: bool
    error: str = ""
    #: The engine's load was attempted and failed (its weights may be gone: vLLM 0.32).
    load_failed: bool = False


@dataclass(slots=True)
class WeightUpdateResult:
    """The outcome of an update: per-engine results and the time the fleet was paused."""

    weight_version: str
    #: Distinct labels the engines in rotation carried before the update.
    previous_versions: list[str] = field(default_factory=list)
    engines: list[EngineOutcome] = field(default_factory=list)
    #: Seconds from the first pause to the last resume.
    paused_s: float = 0.0
    #: Seconds the loads took (the slowest engine's, staged loads added up).
    load_s: float = 0.0
    checkpoint: CheckpointSummary | None = None
    #: True when only engines that missed an earlier update to this version were loaded.
    retry: bool = False

    @property
    def failed(self) -> list[EngineOutcome]:
        return [e for e in self.engines if not e.updated]


#: The dtypes a distributed update may name (torch's names, as both engines take them).
TORCH_DTYPES = frozenset(
    {
        "bfloat16",
        "float16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "uint8",
        "int32",
        "int64",
        "bool",
    }
)
DISTRIBUTED = "source.distributed"


def check_tensors(tensors: Sequence[TensorSpec]) -> None:
    """INVALID_ARGUMENT naming the first tensor field that is wrong."""
    if not tensors:
        raise InvalidArgument(f"{DISTRIBUTED}.tensors", "must list at least one tensor")
    for i, tensor in enumerate(tensors):
        where = f"{DISTRIBUTED}.tensors[{i}]"
        if not tensor.name:
            raise InvalidArgument(f"{where}.name", "must not be empty")
        if tensor.dtype not in TORCH_DTYPES:
            raise InvalidArgument(f"{where}.dtype", f"must be one of {', '.join(sorted(TORCH_DTYPES))}")
        if not tensor.shape or any(d < 1 for d in tensor.shape):
            raise InvalidArgument(f"{where}.shape", f"must list positive sizes; got {list(tensor.shape)[:8]}")


class StepError(Exception):
    """An engine failed at `action`, one step of a multi-step load (init, then receive)."""

    def __init__(self, action: WeightAction, cause: EngineError) -> None:
        super().__init__(cause.message)
        self.action = action
        self.cause = cause


def _as_int(label: str) -> int | None:
    """The label as a non-negative integer when it is spelled as one ("12", not "v12" or "-1")."""
    return int(label) if label.isascii() and label.isdigit() else None


def memory_tags(tags: Sequence[str]) -> tuple[str, ...]:
    """The tags, checked against `MEMORY_TAGS` (INVALID_ARGUMENT naming `tags` otherwise)."""
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise InvalidArgument("tags", f"must be among {', '.join(MEMORY_TAGS)}; got {unknown[:4]}")
    return tuple(dict.fromkeys(tags))


def check_version(new: str, current: Sequence[str], used: Sequence[str] = ()) -> None:
    """Refuse a label that goes backwards: FAILED_PRECONDITION naming both labels.

    "Backwards" is defined so that staleness (`Sample.weight_versions`) stays meaningful:
    * the label equals one an engine in rotation carries now, or one this replica set earlier
      (a label names one set of weights; reusing it would mix two under one name);
    * both labels are decimal integers (`"7"`, `"12"`) and the new one is not greater.
    Other labels (`"step-12"`, hashes) only need to be new.
    """
    if not new or len(new) > MAX_VERSION_CHARS or any(ord(c) < 0x20 for c in new):
        raise InvalidArgument(
            VERSION_FIELD, f"must be 1..{MAX_VERSION_CHARS} printable characters; got {new[:64]!r}"
        )
    for label in current:
        if new == label:
            raise FailedPrecondition(f"{VERSION_FIELD} {new!r} is the version the engines already serve")
        old_n, new_n = _as_int(label), _as_int(new)
        if old_n is not None and new_n is not None and new_n <= old_n:
            raise FailedPrecondition(f"{VERSION_FIELD} {new!r} goes backwards from {label!r}")
    if new in used:
        raise FailedPrecondition(f"{VERSION_FIELD} {new!r} was already used by an earlier update")
