"""slime's training actor with its weight update routed to the rollout service (needs slime).

Importable only where slime and its trainer stack are (torch, Megatron, Ray): `slime_train` passes
`ServiceWeightsActor` to slime's `create_training_models(..., actor_cls=)`, slime's own extension
point for the actor class. It is slime's `MegatronTrainRayActor` with one method replaced,
`update_weights()`: slime's version asks its rollout manager for SGLang engines and skips the update
when there are none (this run starts none); this one always writes the checkpoint with slime's own
`UpdateWeightFromDisk` (`--update-weight-disk-dir`, every rank) and has rank 0 move the service's
fleet to it (`slime_weights.push_checkpoint`: one UpdateWeights, labelled with slime's version).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch.distributed as dist  # type: ignore[import-not-found]
from slime.backends.megatron_utils.actor import MegatronTrainRayActor  # type: ignore[import-not-found]
from slime.utils.distributed_utils import get_gloo_group  # type: ignore[import-not-found]
from slime.utils.reloadable_process_group import (  # type: ignore[import-not-found]
    destroy_process_groups,
    reload_process_groups,
)
from torch_memory_saver import torch_memory_saver  # type: ignore[import-not-found]

from rollout_grpc.integrations.slime_weights import push_checkpoint, version_dir


class ServiceWeightsActor(MegatronTrainRayActor):  # type: ignore[misc]
    """slime's Megatron actor whose weight updates go to the rollout service."""

    def update_weights(self) -> None:
        """Write the HF checkpoint (slime's disk updater, all ranks), then UpdateWeights on rank 0."""
        if self.args.debug_rollout_only:
            return
        if self.args.offload_train:
            reload_process_groups()  # the updater's barriers need the gloo group, as in slime
        with torch_memory_saver.disable() if self.args.offload_train else nullcontext():
            self.weight_updater.update_weights()  # slime's UpdateWeightFromDisk: weight_vNNNNNN
            directory = version_dir(self.args, self.weight_updater.weight_version)
            if dist.get_rank() == 0:
                push_checkpoint(self.args, directory)
            dist.barrier(group=get_gloo_group())  # no rank trains on before the fleet has it
        if self.args.offload_train:
            destroy_process_groups()
