"""The checks of UpdateWeights before any engine is touched: path prefix, checkpoint files, version order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from rollout_grpc.server.rollout.checkpoint import allowed_path, inspect_checkpoint
from rollout_grpc.server.rollout.weights import check_version
from tests.support.checkpoints import toy_checkpoint, truncate, write_safetensors


def test_a_path_under_a_prefix_is_allowed_by_whole_components() -> None:
    assert allowed_path("/ckpt/run1/step-3", ["/ckpt"]) == "/ckpt/run1/step-3"
    assert allowed_path("/ckpt/run1/", ["/other", "/ckpt/run1"]) == "/ckpt/run1"
    with pytest.raises(PermissionDenied, match="--weights-path-prefix"):
        allowed_path("/ckpt-other/x", ["/ckpt"])
    with pytest.raises(PermissionDenied, match="outside"):
        allowed_path("/etc", ["/ckpt"])


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "must not be empty"),
        ("ckpt/run1", "absolute"),
        ("/ckpt/../etc", "normal path"),
        ("/ckpt/./x", "normal path"),
        ("/ckpt//x", "normal path"),
        ("/ckpt/x\n", "control characters"),
    ],
)
def test_a_path_that_is_not_plain_is_refused_naming_the_field(path: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why) as info:
        allowed_path(path, ["/ckpt"])
    assert info.value.field == "source.checkpoint.path"


def test_without_a_prefix_checkpoint_updates_are_off_naming_the_flag() -> None:
    with pytest.raises(FailedPrecondition, match="--weights-path-prefix"):
        allowed_path("/ckpt/x", [])


def test_a_sound_checkpoint_passes(tmp_path: Path) -> None:
    summary = inspect_checkpoint(str(toy_checkpoint(tmp_path / "v1", seed=1)), [str(tmp_path)])
    assert (summary.files, summary.tensors) == (1, 2)


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="not a directory"):
        inspect_checkpoint(str(tmp_path / "gone"), [str(tmp_path)])


def test_a_directory_without_safetensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FailedPrecondition, match=r"no \*\.safetensors"):
        inspect_checkpoint(str(tmp_path), [str(tmp_path)])


def test_a_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    ckpt = toy_checkpoint(tmp_path / "v1", seed=1)
    truncate(ckpt / "model.safetensors")
    with pytest.raises(FailedPrecondition, match=r"model\.safetensors"):
        inspect_checkpoint(str(ckpt), [str(tmp_path)])


def test_a_padded_file_and_a_wrong_size_are_refused(tmp_path: Path) -> None:
    ckpt = toy_checkpoint(tmp_path / "v1", seed=1)
    with (ckpt / "model.safetensors").open("ab") as fh:
        fh.write(b"\0" * 16)
    with pytest.raises(FailedPrecondition, match="covers"):
        inspect_checkpoint(str(ckpt), [str(tmp_path)])
    bad = tmp_path / "bad"
    bad.mkdir()
    write_safetensors(bad / "model.safetensors", {"w": np.zeros(4, np.float32)})
    raw = (bad / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["w"]["shape"] = [5]
    text = json.dumps(header).encode().ljust(n)
    (bad / "model.safetensors").write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(FailedPrecondition, match="bytes for shape"):
        inspect_checkpoint(str(bad), [str(tmp_path)])


def test_a_garbage_header_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes((4).to_bytes(8, "little") + b"nope")
    with pytest.raises(FailedPrecondition, match="not JSON"):
        inspect_checkpoint(str(tmp_path), [str(tmp_path)])
    (tmp_path / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(FailedPrecondition, match="header length"):
        inspect_checkpoint(str(tmp_path), [str(tmp_path)])


def test_an_index_naming_a_missing_shard_is_refused(tmp_path: Path) -> None:
    ckpt = toy_checkpoint(tmp_path / "v1", seed=1)
    index = {"weight_map": {"a": "model.safetensors", "b": "model-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FailedPrecondition, match="model-00002"):
        inspect_checkpoint(str(ckpt), [str(tmp_path)])


def test_a_symlink_leaving_the_prefix_is_refused(tmp_path: Path) -> None:
    outside = toy_checkpoint(tmp_path / "outside", seed=1)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link").symlink_to(outside)
    with pytest.raises(PermissionDenied, match="resolves to"):
        inspect_checkpoint(str(allowed / "link"), [str(allowed)])


def test_versions_must_move_forward() -> None:
    check_version("v1", ["default"])
    check_version("12", ["7"])
    check_version("step-3", ["12"])  # not both integers: only new
    with pytest.raises(FailedPrecondition, match="already serve"):
        check_version("v1", ["v1"])
    with pytest.raises(FailedPrecondition, match="goes backwards"):
        check_version("7", ["12"])
    with pytest.raises(FailedPrecondition, match="goes backwards"):
        check_version("07", ["7"])  # the same step, spelt differently
    with pytest.raises(FailedPrecondition, match="already used"):
        check_version("v1", ["v2"], used=["v1", "v2"])
    with pytest.raises(InvalidArgument, match="printable"):
        check_version("", ["v0"])
    with pytest.raises(InvalidArgument, match="printable"):
        check_version("x" * 257, ["v0"])
