"""slime's weight updates, routed to the rollout service instead of slime's own SGLang engines.

slime (THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515) moves new weights to its engines in
`MegatronTrainRayActor.update_weights()`: it asks its rollout manager for the SGLang engines it
started and hands them to a weight updater chosen by `--update-weight-transport` (`disk`:
`UpdateWeightFromDisk` writes an HF checkpoint under `--update-weight-disk-dir`, then
`RayTrainGroup` makes every engine pause, `update_weights_from_disk` and continue; `nccl`: a
broadcast to the engines' ranks). When the rollout manager has no engines the actor skips the
update, so a run whose engines sit behind this service would train on the initial policy forever.

`slime_train` replaces that actor method (`slime_actor.ServiceWeightsActor.update_weights`): slime's
own `UpdateWeightFromDisk` still writes the checkpoint, and rank 0 then moves the whole fleet to it
with one `UpdateWeights` call (`push_checkpoint`). This module is the part that needs no slime: the
checkpoint's directory and version as slime names them, the service calls, and the refusal of every
slime setting the routed update cannot honour (`check_train_args`). The service calls use the hook's
address, token and TLS settings (`slime.client_settings`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client import RolloutClient
from rollout_grpc.integrations.slime import credentials_of, target_of

#: This project's rollout and eval functions (the only ones that need no SGLang router).
OWN_ROLLOUT = "rollout_grpc.integrations.slime_step.generate_rollout"
#: slime's default rollout function (its abort asks the SGLang router for `/workers`).
SLIME_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"

#: slime's checkpoint directory per update (`UpdateWeightFromDisk`: `weight_v{version:06d}`).
_VERSION_DIR = re.compile(r"weight_v(\d{6,})")

#: The memory regions slime's rollout manager takes back after a colocated step, as service tags.
ONLOAD_WEIGHTS = ("weights",)
ONLOAD_KV = ("kv_cache",)


#: slime settings (attribute: flag) that act on slime's own SGLang engines.
_OWN_ENGINE_SETTINGS = {
    "use_fault_tolerance": "--use-fault-tolerance",
    "check_weight_update_equal": "--check-weight-update-equal",
    "rollout_external_engine_addrs": "--rollout-external-engine-addrs",
}


def version_dir(args: Any, version: int) -> Path:
    """The directory slime's `UpdateWeightFromDisk` writes update `version` into."""
    return Path(args.update_weight_disk_dir) / f"weight_v{version:06d}"


def version_of(directory: str | Path) -> str:
    """The label of a slime update directory: its version number as slime's SGLang engines get it
    (`weight_v000012` -> "12"); ValueError for a directory slime did not name."""
    match = _VERSION_DIR.fullmatch(Path(directory).name)
    if match is None:
        raise ValueError(f"{str(directory)!r} is not a slime weight directory (weight_vNNNNNN)")
    return str(int(match.group(1)))


def service_client(args: Any) -> RolloutClient:
    """A blocking client of the hook's target with its token and TLS settings (the trainer's
    actors are synchronous code; one short-lived client per call keeps no channel across forks)."""
    return RolloutClient(target_of(args), **credentials_of(args))


def push_checkpoint(args: Any, directory: str | Path, pause_mode: str = "keep") -> pb.UpdateWeightsResponse:
    """Move every engine behind the service to the HF checkpoint slime wrote in `directory`,
    labelled with its version (`UpdateWeights`). Raises the client's errors naming the engines that
    did not take it (the update then stops the trainer, as a failed SGLang reload does in slime)."""
    label = version_of(directory)
    with service_client(args) as client:
        return client.update_weights(str(directory), label, pause_mode=pause_mode)


def release_memory(args: Any) -> pb.ReleaseMemoryResponse:
    """slime's `rollout_manager.offload()` (colocated): every engine pauses and frees its memory."""
    with service_client(args) as client:
        return client.release_memory()


def resume_memory(args: Any, tags: tuple[str, ...]) -> pb.ResumeMemoryResponse:
    """slime's `onload_weights()` / `onload_kv()`: the engines take the regions back."""
    with service_client(args) as client:
        return client.resume_memory(tags)


def _transport_refusals(args: Any) -> list[str]:
    refusals = []
    transport = getattr(args, "update_weight_transport", "nccl")
    if transport != "disk" or not getattr(args, "update_weight_disk_dir", None):
        refusals.append(
            f"--update-weight-transport {transport}: the routed update moves the checkpoint slime writes; "
            "run with --update-weight-transport disk --update-weight-disk-dir DIR (a directory every "
            "engine reads, under the replica's --weights-path-prefix). The NCCL broadcast needs slime's "
            "engine handles; a trainer of its own drives it with PlanWeightTransfer + UpdateWeights "
            "(docs/slime.md)"
        )
    if getattr(args, "update_weight_mode", "full") != "full":
        refusals.append(
            "--update-weight-mode delta: each SGLang host patches its own copy (/pull_weights); the "
            "engines behind the service read full checkpoints: use --update-weight-mode full"
        )
    if getattr(args, "update_weight_local_checkpoint_dir", None):
        refusals.append(
            "--update-weight-local-checkpoint-dir: the engines pull through slime's SGLang engines; "
            "the service's engines read --update-weight-disk-dir directly: drop it"
        )
    return refusals


def _loop_refusals(args: Any) -> list[str]:
    refusals = []
    for flag, default_ok in (("rollout_function_path", False), ("eval_function_path", True)):
        path = getattr(args, flag, None)
        if path != OWN_ROLLOUT and not (default_ok and path is None):
            refusals.append(
                f"--{flag.replace('_', '-')} {path!r}: without slime's engines only {OWN_ROLLOUT} "
                "generates (slime's own rollout asks its SGLang router for /workers to abort)"
            )
    if getattr(args, "release_train", False):
        refusals.append(
            "--release-train: slime_train keeps the training actors (it does not recreate them per step); "
            "drop it"
        )
    if getattr(args, "keep_old_actor", False):
        refusals.append(
            "--keep-old-actor: slime keeps its old-actor copy inside its own update_weights, which "
            "slime_train replaces; drop it"
        )
    for attribute, flag in _OWN_ENGINE_SETTINGS.items():
        if getattr(args, attribute, None):
            refusals.append(
                f"{flag}: it acts on slime's SGLang engines, which this run does not start (the service "
                "health-checks and drains its own engines)"
            )
    return refusals


def check_train_args(args: Any) -> None:
    """Refuse a run whose settings need slime's own SGLang engines or router (every reason at
    once), before any GPU is allocated."""
    refusals = _transport_refusals(args) + _loop_refusals(args)
    if refusals:
        raise ValueError("slime_train cannot run these settings:\n* " + "\n* ".join(refusals))
