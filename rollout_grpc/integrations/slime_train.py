"""Run slime's training with no SGLang engines or router of its own: `python -m
rollout_grpc.integrations.slime_train <slime's flags>` instead of slime's `train.py`.

What differs from slime's `train.py` (THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515), and why:

* `--debug-train-only` is added: slime then parses no `--sglang-*` flags, reserves no rollout GPUs
  and its rollout manager starts no SGLang engine and no router. Generation runs on the service
  through `--rollout-function-path rollout_grpc.integrations.slime_step.generate_rollout`, which
  the rollout manager still calls for every rollout.
* The actor class is `slime_actor.ServiceWeightsActor` (slime's `actor_cls` extension point): its
  `update_weights()` writes the checkpoint with slime's disk updater and moves the service's whole
  fleet to it with one UpdateWeights (slime's own method would find no engines and skip). So
  `actor_model.update_weights()` — at start and after every step, where slime calls it — is the
  routed update.
* Evaluation runs here (slime's rollout manager skips eval under `--debug-train-only`): the eval
  function (this project's, `slime_eval`) and slime's own `log_eval_rollout_data`.
* Colocated runs (`--offload-rollout`): slime's `offload` / `onload_weights` / `onload_kv` of its
  engines become the service's ReleaseMemory / ResumeMemory(weights) / ResumeMemory(kv_cache).

Settings that need slime's engines are refused before anything starts (`slime_weights.check_train_args`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rollout_grpc.integrations import slime_weights

#: What becomes of each call slime's `train.py` makes on its rollout manager (checked against slime's
#: source by tests/integration/test_slime_train.py, so a new call in slime is noticed).
ROLLOUT_MANAGER_CALLS = {
    "generate": "kept: the rollout manager calls --rollout-function-path (the service's RolloutStep)",
    "save": "kept: the data source's state",
    "dispose": "kept",
    "eval": "run here: the eval function and slime's log_eval_rollout_data",
    "offload": "ReleaseMemory (every engine behind the service)",
    "onload_weights": "ResumeMemory(weights)",
    "onload_kv": "ResumeMemory(kv_cache)",
    "check_weights": "refused (--check-weight-update-equal)",
}
#: What becomes of each call slime's `train.py` makes on its actor group.
ACTOR_MODEL_CALLS = {
    "update_weights": "ServiceWeightsActor.update_weights: slime's disk checkpoint, then UpdateWeights",
    "async_train": "kept",
    "save_model": "kept",
    "clear_memory": "kept",
    "create": "refused (--release-train)",
}

#: The flag that makes slime start no SGLang engine or router of its own.
NO_OWN_ENGINES = "--debug-train-only"


def _run_eval(args: Any, rollout_id: int) -> None:
    """slime's `rollout_manager.eval(rollout_id)` on the service: our eval, slime's logging."""
    from slime.observability.rollout_metrics import log_eval_rollout_data  # type: ignore[import-not-found]
    from slime.rollout.base_types import call_rollout_fn  # type: ignore[import-not-found]
    from slime.utils.misc import load_function  # type: ignore[import-not-found]

    result = call_rollout_fn(load_function(args.eval_function_path), args, rollout_id, None, evaluation=True)
    log_eval_rollout_data(rollout_id, args, result.data, result.metrics)


class _Run:
    """One slime training run: slime's placement, rollout manager and actors, our weight route."""

    def __init__(self, args: Any) -> None:
        import ray  # type: ignore[import-not-found]
        from slime.observability.logging_utils import configure_logger, init_tracking  # type: ignore[import-not-found]
        from slime.ray.placement_group import (  # type: ignore[import-not-found]
            create_placement_groups,
            create_rollout_manager,
            create_training_models,
        )

        from rollout_grpc.integrations.slime_actor import ServiceWeightsActor

        self.ray = ray
        self.args = args
        configure_logger()
        pgs = create_placement_groups(args)
        init_tracking(args)
        self.rollout_manager, self.per_epoch = create_rollout_manager(args, pgs["rollout"])
        self.actor, self.critic = create_training_models(
            args, pgs, self.rollout_manager, actor_cls=ServiceWeightsActor
        )
        self.colocated = bool(args.offload_rollout)

    def push_weights(self) -> None:
        """slime's `actor_model.update_weights()` with its engines' memory calls around it."""
        if self.colocated:
            slime_weights.resume_memory(self.args, slime_weights.ONLOAD_WEIGHTS)
        self.actor.update_weights()  # ServiceWeightsActor.update_weights on every rank
        if self.colocated:
            slime_weights.resume_memory(self.args, slime_weights.ONLOAD_KV)

    def train_step(self, rollout_id: int) -> bool:
        """Generate (the rollout manager calls the service's rollout), free the engines when
        colocated, train. Whether the actor trained."""
        args, ray = self.args, self.ray
        data = ray.get(self.rollout_manager.generate.remote(rollout_id))
        if self.colocated:
            slime_weights.release_memory(args)
        trains = not args.use_critic or rollout_id >= args.num_critic_only_steps
        if not args.use_critic:
            ray.get(self.actor.async_train(rollout_id, data))
            return trains
        values = self.critic.async_train(rollout_id, data)
        ray.get(self.actor.async_train(rollout_id, data, external_data=values) if trains else values)
        return trains

    def save(self, rollout_id: int, trains: bool) -> None:
        args = self.args
        last = rollout_id == args.num_rollout - 1
        if trains:
            self.actor.save_model(rollout_id, force_sync=last)
        if args.use_critic:
            self.critic.save_model(rollout_id, force_sync=last)
        if args.rollout_global_dataset:
            self.ray.get(self.rollout_manager.save.remote(rollout_id))

    def run(self) -> None:
        # slime's modules are untyped here (mypy knows them from the imports above)
        from slime.observability.logging_utils import finish_tracking
        from slime.utils.misc import should_run_periodic_action

        args = self.args
        if self.colocated:
            slime_weights.release_memory(args)  # the engines free their memory until the first push
        self.push_weights()  # the engines serve the trainer's initial weights, labelled "1"
        if args.num_rollout == 0 and args.eval_interval is not None:
            _run_eval(args, 0)
        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            if args.eval_interval is not None and rollout_id == 0 and not args.skip_eval_before_train:
                _run_eval(args, rollout_id)
            trains = self.train_step(rollout_id)
            if should_run_periodic_action(rollout_id, args.save_interval, self.per_epoch, args.num_rollout):
                self.save(rollout_id, trains)
            if not args.offload_train:
                (self.actor if not args.use_critic or trains else self.critic).clear_memory()
            self.push_weights()
            if should_run_periodic_action(rollout_id, args.eval_interval, self.per_epoch):
                _run_eval(args, rollout_id)
        self.ray.get(self.rollout_manager.dispose.remote())
        finish_tracking(args)


def train(args: Any) -> None:
    """slime's training loop with the rollout on the service and weight updates routed to it."""
    slime_weights.check_train_args(args)  # before any GPU is reserved
    _Run(args).run()


def with_own_engines_off(argv: Sequence[str]) -> list[str]:
    """slime's command line with `--debug-train-only` (added once)."""
    return list(argv) if NO_OWN_ENGINES in argv else [*argv, NO_OWN_ENGINES]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse slime's flags (slime's own parser) and train."""
    sys.argv = [sys.argv[0], *with_own_engines_off(sys.argv[1:] if argv is None else argv)]
    from slime.utils.arguments import parse_args  # type: ignore[import-not-found]

    train(parse_args())


if __name__ == "__main__":
    main()
