"""Weight updates: new weights reach every engine as one serialised, fleet-wide operation.

`UpdateWeights` (docs/api.md, docs/engines.md "Weight updates") runs, for a checkpoint source:

1. checks before any engine is touched: the path is under an operator's `--weights-path-prefix`
   and the checkpoint's files are sound (`checkpoint.py`: a failed load kills a vLLM 0.32 engine),
   and the new version label does not go backwards (`check_version`);
2. pauses every engine in the caller's mode (`Control.pause`: abort, wait or keep, as `Pause`);
3. loads the checkpoint: on one engine first, then on the others concurrently (`staged`, the
   default), so that a checkpoint the engines refuse costs one engine, not the fleet;
4. labels the engines that loaded with the new version (`/update_weight_version`);
5. takes every engine that was not paused, did not load or was not labelled out of rotation
   (`EnginePool.set_weights_problem`: no new generations; re-admitted only by a later update that
   loads on it), and resumes every engine (`Control.resume`) — kept generations of an engine that
   did not load go on under its old label, which is still true of its weights.

So after the call every engine in rotation serves the new weights under the new label; when some
engine did not, the call fails (UNAVAILABLE) naming each engine and cause, and repeating the same
call (same version, same path) loads only those engines. A second update while one runs, on any
replica or worker sharing the state store, is refused (FAILED_PRECONDITION naming the holder),
never interleaved: before touching any engine an update takes the fleet lease `weights` in the
store (`BufferStore.take_lease`), renews it every third of `--weights-lease-ttl` while it runs and
releases it at its end, so a replica killed mid-update blocks the others for at most that TTL.
The new version must not go backwards from the fleet's order (in the store, `step/versions.py`),
and becomes its newest once an engine took it. When the caller disconnects mid-update, the update runs to
its end (the fleet is resumed on a consistent version) and `weight_update_done` /
`weight_update_failed` says which version the engines ended on.

Colocated training frees and takes back the engines' memory with `release_memory` /
`resume_memory` (ReleaseMemory / ResumeMemory): serialised with the updates (each holds the same
fleet lease while it runs), the engines paused (ABORT) before they free anything and resumed once
every region is back.

Plain Pause / Resume take no lease: they are two calls, possibly to two replicas, and a lease held
between them would outlive a trainer that died in between with nothing to renew or release it.
A Resume(weight_version) still goes through the fleet's version order (never backwards).
"""

from rollout_grpc.server.engines.api import MemoryRelease, TensorSpec, TransferGroup
from rollout_grpc.server.rollout.weights.updates import WeightUpdates
from rollout_grpc.server.rollout.weights.values import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LOAD_TIMEOUT_S,
    CheckpointSource,
    DistributedSource,
    EngineOutcome,
    TransferPlan,
    WeightUpdate,
    WeightUpdateResult,
    check_version,
)

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_LOAD_TIMEOUT_S",
    "CheckpointSource",
    "DistributedSource",
    "EngineOutcome",
    "MemoryRelease",
    "TensorSpec",
    "TransferGroup",
    "TransferPlan",
    "WeightUpdate",
    "WeightUpdateResult",
    "WeightUpdates",
    "check_version",
]
