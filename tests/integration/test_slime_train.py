"""slime's weight updates routed to the service (`integrations/slime_train.py`, `slime_actor.py`,
`slime_weights.py`): the calls slime's loop makes become service calls on a real replica over
simulated engines, every slime setting that needs slime's own engines is refused naming its flag,
and, with `SLIME_SRC`, every assumption about slime's code is checked against the pinned commit."""

from __future__ import annotations

import ast
import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollout_grpc.client.errors import FailedPreconditionError, PermissionDeniedError
from rollout_grpc.integrations import slime_train, slime_weights
from tests.harness import Harness, harness
from tests.support import slime_real
from tests.support.checkpoints import toy_checkpoint


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Harness]:
    async with harness("sim", sim_count=3, weights_path_prefixes=[str(tmp_path / "sync")]) as h:
        yield h


def run_args(target: str, tmp_path: Path, **overrides: Any) -> SimpleNamespace:
    """The slime settings of a run with slime_train (slime's defaults where they are fine)."""
    values: dict[str, Any] = {
        "rollout_grpc_target": target,
        "update_weight_transport": "disk",
        "update_weight_mode": "full",
        "update_weight_disk_dir": str(tmp_path / "sync"),
        "update_weight_local_checkpoint_dir": None,
        "rollout_function_path": slime_weights.OWN_ROLLOUT,
        "eval_function_path": slime_weights.OWN_ROLLOUT,
        "release_train": False,
        "keep_old_actor": False,
        "use_fault_tolerance": False,
        "check_weight_update_equal": False,
        "rollout_external_engine_addrs": None,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def write_update(args: Any, version: int, seed: int) -> Path:
    """What slime's UpdateWeightFromDisk leaves for update `version`: an HF checkpoint directory."""
    return toy_checkpoint(slime_weights.version_dir(args, version), seed=seed)


async def test_the_colocated_step_reaches_every_engine_under_slimes_version(
    fleet: Harness, tmp_path: Path
) -> None:
    """What slime_train does around `actor_model.update_weights()` with --offload-rollout: free the
    engines, take the weights back, load slime's checkpoint, take the KV cache back."""
    args = run_args(fleet.target, tmp_path)
    directory = write_update(args, 1, seed=1)
    await asyncio.to_thread(slime_weights.release_memory, args)
    assert all(s.core.sleeping and s.core.paused for s in fleet.sims)
    await asyncio.to_thread(slime_weights.resume_memory, args, slime_weights.ONLOAD_WEIGHTS)
    response = await asyncio.to_thread(slime_weights.push_checkpoint, args, directory)
    assert response.weight_version == "1" and all(e.updated for e in response.engines)
    assert all(s.core.paused and s.core.version == "1" for s in fleet.sims)  # KV cache still away
    await asyncio.to_thread(slime_weights.resume_memory, args, slime_weights.ONLOAD_KV)
    assert all(not s.core.sleeping and not s.core.paused for s in fleet.sims)
    # The next step (not colocated): slime's next directory, its next label.
    await asyncio.to_thread(slime_weights.push_checkpoint, args, write_update(args, 2, seed=2))
    assert {s.core.version for s in fleet.sims} == {"2"}
    assert all(s.stats.weight_loads == 2 for s in fleet.sims)


async def test_a_restarted_trainer_cannot_move_the_fleet_backwards(fleet: Harness, tmp_path: Path) -> None:
    args = run_args(fleet.target, tmp_path)
    await asyncio.to_thread(slime_weights.push_checkpoint, args, write_update(args, 3, seed=3))
    with pytest.raises(FailedPreconditionError, match="backwards"):
        await asyncio.to_thread(slime_weights.push_checkpoint, args, write_update(args, 2, seed=2))
    assert {s.core.version for s in fleet.sims} == {"3"}


async def test_a_disk_dir_outside_the_replicas_prefix_is_refused(fleet: Harness, tmp_path: Path) -> None:
    args = run_args(fleet.target, tmp_path, update_weight_disk_dir=str(tmp_path / "elsewhere"))
    with pytest.raises(PermissionDeniedError, match="--weights-path-prefix"):
        await asyncio.to_thread(slime_weights.push_checkpoint, args, write_update(args, 1, seed=1))
    assert all(s.stats.weight_loads == 0 for s in fleet.sims)


def test_the_label_is_slimes_version_number() -> None:
    assert slime_weights.version_of("/ckpt/weight_v000012") == "12"
    assert slime_weights.version_of(Path("/ckpt/weight_v1234567")) == "1234567"
    with pytest.raises(ValueError, match="not a slime weight directory"):
        slime_weights.version_of("/ckpt/step-12")
    args = SimpleNamespace(update_weight_disk_dir="/ckpt")
    assert slime_weights.version_dir(args, 7) == Path("/ckpt/weight_v000007")


@pytest.mark.parametrize(
    ("setting", "value", "named"),
    [
        ("update_weight_transport", "nccl", "--update-weight-transport nccl"),
        ("update_weight_disk_dir", None, "--update-weight-disk-dir"),
        ("update_weight_mode", "delta", "--update-weight-mode delta"),
        ("update_weight_local_checkpoint_dir", "/nvme", "--update-weight-local-checkpoint-dir"),
        ("rollout_function_path", slime_weights.SLIME_ROLLOUT, "--rollout-function-path"),
        ("eval_function_path", "my.eval", "--eval-function-path"),
        ("release_train", True, "--release-train"),
        ("keep_old_actor", True, "--keep-old-actor"),
        ("use_fault_tolerance", True, "--use-fault-tolerance"),
        ("check_weight_update_equal", True, "--check-weight-update-equal"),
        ("rollout_external_engine_addrs", ["10.0.0.1:30000"], "--rollout-external-engine-addrs"),
    ],
)
def test_a_setting_that_needs_slimes_engines_is_refused_naming_it(
    tmp_path: Path, setting: str, value: Any, named: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        slime_weights.check_train_args(run_args("127.0.0.1:1", tmp_path, **{setting: value}))


def test_a_run_slime_train_can_do_passes_and_slime_starts_no_engines(tmp_path: Path) -> None:
    slime_weights.check_train_args(run_args("127.0.0.1:1", tmp_path))
    slime_weights.check_train_args(run_args("127.0.0.1:1", tmp_path, eval_function_path=None))
    assert slime_train.with_own_engines_off(["--num-rollout", "3"]) == [
        "--num-rollout",
        "3",
        "--debug-train-only",
    ]
    assert slime_train.with_own_engines_off(["--debug-train-only"]) == ["--debug-train-only"]


# ------------------------------------------------------------------------ slime's own code (pinned)

needs_slime = pytest.mark.skipif(
    slime_real.root() is None,
    reason=f"SLIME_SRC is not set to a THUDM/slime checkout (tests written at {slime_real.PINNED})",
)


def _source(relative: str) -> str:
    root = slime_real.root()
    assert root is not None
    return (root / relative).read_text()


def _method(relative: str, cls: str, name: str) -> ast.FunctionDef:
    for node in ast.parse(_source(relative)).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise LookupError(f"{relative}: {cls}.{name}")


def _calls_on(tree: ast.AST, receiver: str) -> set[str]:
    """Methods called on the variable `receiver` (`receiver.m(...)` and `receiver.m.remote(...)`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == receiver:
            found.add(node.attr)
    return found


@needs_slime
def test_every_call_of_slimes_training_loop_is_accounted_for() -> None:
    """slime_train follows slime's train.py: each call slime makes on its rollout manager and actor
    group is kept, mapped to the service or refused (a new call in slime fails here)."""
    loop = ast.parse(_source("train.py"))
    assert _calls_on(loop, "rollout_manager") <= set(slime_train.ROLLOUT_MANAGER_CALLS)
    assert _calls_on(loop, "actor_model") <= set(slime_train.ACTOR_MODEL_CALLS)
    assert "update_weights" in _calls_on(loop, "actor_model")


@needs_slime
def test_the_replaced_method_and_the_extension_point_are_slimes() -> None:
    """The actor class is slime's `actor_cls` parameter; the replaced method is
    `MegatronTrainRayActor.update_weights(self)`, which skips when slime started no engines."""
    params = dict(slime_real.function_parameters("slime/ray/placement_group.py", "create_training_models"))
    assert params.get("actor_cls", ...) is None
    update = _method("slime/backends/megatron_utils/actor.py", "MegatronTrainRayActor", "update_weights")
    assert [a.arg for a in update.args.args] == ["self"]
    body = ast.unparse(update)
    # Under --debug-train-only (how slime_train starts no engines) and without engines it returns.
    assert "if self.args.debug_train_only or self.args.debug_rollout_only:\n        return" in body
    assert "if not rollout_engines and (not reconnect_rollout_engines):" in body
    assert "self.weight_updater.update_weights()" in body
    # The imports slime_actor uses from slime exist where it imports them from.
    actor = _source("slime/backends/megatron_utils/actor.py")
    assert "class MegatronTrainRayActor(" in actor
    assert "def destroy_process_groups" in _source("slime/utils/reloadable_process_group.py")
    assert "def reload_process_groups" in _source("slime/utils/reloadable_process_group.py")
    assert "def get_gloo_group" in _source("slime/utils/distributed_utils.py")


@needs_slime
def test_slimes_disk_updater_writes_where_the_route_reads() -> None:
    """--update-weight-transport disk picks UpdateWeightFromDisk, which writes
    `weight_v{version:06d}` under --update-weight-disk-dir and counts `weight_version` up."""
    selection = ast.unparse(
        _method("slime/backends/megatron_utils/actor.py", "MegatronTrainRayActor", "init")
    )
    assert (
        "elif update_weight_transport == 'disk':\n        update_weight_cls = UpdateWeightFromDisk"
        in selection
    )
    update = ast.unparse(
        _method(
            "slime/backends/megatron_utils/update_weight/update_weight_from_disk.py",
            "UpdateWeightFromDisk",
            "update_weights",
        )
    )
    assert "self.weight_version += 1" in update
    assert "Path(self.args.update_weight_disk_dir) / f'weight_v{self.weight_version:06d}'" in update
    assert slime_weights.version_dir(SimpleNamespace(update_weight_disk_dir="/d"), 3).name == "weight_v000003"
    # With no engines, slime's group reload after the actors' update does nothing but clean up.
    reload = ast.unparse(
        _method("slime/ray/actor_group.py", "RayTrainGroup", "_reload_rollout_weights_from_disk")
    )
    assert "if not engines:" in reload


@needs_slime
def test_debug_train_only_starts_no_sglang_engine_router_or_gpu() -> None:
    init = ast.unparse(_method("slime/ray/rollout.py", "RolloutManager", "__init__"))
    assert "if self.args.debug_train_only:\n        self.servers: dict[str, Any] = {}" in init
    layout = ast.unparse(
        next(
            n
            for n in ast.parse(_source("slime/ray/placement_group.py")).body
            if isinstance(n, ast.FunctionDef) and n.name == "_get_placement_group_layout"
        )
    )
    assert "if args.debug_train_only:\n        return (actor_num_gpus, 0)" in layout
    assert "skip_sglang = pre.debug_train_only" in _source("slime/utils/arguments.py")
    # ... and its eval is skipped, which is why slime_train runs the eval itself.
    assert "if self.args.debug_train_only:\n        return" in ast.unparse(
        _method("slime/ray/rollout.py", "RolloutManager", "eval")
    )


@needs_slime
def test_every_flag_the_refusals_name_is_slimes(tmp_path: Path) -> None:
    everything = run_args(
        "127.0.0.1:1",
        tmp_path,
        update_weight_transport="nccl",
        update_weight_mode="delta",
        update_weight_local_checkpoint_dir="/nvme",
        rollout_function_path="x.y",
        eval_function_path="x.y",
        release_train=True,
        keep_old_actor=True,
        use_fault_tolerance=True,
        check_weight_update_equal=True,
        rollout_external_engine_addrs=["a:1"],
    )
    with pytest.raises(ValueError) as refused:
        slime_weights.check_train_args(everything)
    named = set(re.findall(r"--[a-z][a-z-]+[a-z]", str(refused.value))) - {"--weights-path-prefix"}
    assert len(named) == 11
    definitions = _source("slime/utils/arguments.py") + _source("slime/backends/megatron_utils/arguments.py")
    missing = sorted(flag for flag in named if f'"{flag}"' not in definitions)
    assert not missing, f"not slime flags at {slime_real.PINNED}: {missing}"
