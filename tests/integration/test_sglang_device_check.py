"""The SGLang device check (`tools/sglang/device_check.sh` and its driver) on a machine without a GPU.

The shell script must fail fast, with one clear line, where no GPU is listed; the driver's
`--engine-url` mode runs every check through a real replica against the SGLang simulator started as
its own server process, so the driver a GPU run uses is exercised on every pass (and a simulator
without `--enable-deterministic-inference` must make it fail, exit non-zero, on the seed check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO, Processes, start_engine

SCRIPT = REPO / "tools" / "sglang" / "device_check.sh"
DRIVER = REPO / "tools" / "sglang" / "device_check.py"
CHECKS = [
    "capabilities",
    "logprob_definition",
    "seed_honoured",
    "abort_all_continue",
    "abort_all_over_paused",
    "queued_abort_echo",
    "pause_continue_versions",
    "multimodal_ids",
]


def run_script(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "HOME": str(tmp_path), "SGLANG_DEVICE_CHECK_DIR": str(tmp_path / "work")}
    return subprocess.run(
        ["/bin/bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_without_nvidia_smi_it_fails_fast_with_one_line(tmp_path: Path) -> None:
    done = run_script(tmp_path, "")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == ["device_check: no GPU: nvidia-smi not found on PATH"]
    assert not (tmp_path / "work").exists(), "nothing is installed without a GPU"


def test_an_nvidia_smi_listing_no_gpu_fails_fast(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    fake.chmod(0o755)
    done = run_script(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert done.returncode != 0
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("device_check: no GPU: nvidia-smi -L lists none")
    assert not (tmp_path / "work").exists()


def run_driver(tmp_path: Path, *sim_flags: str) -> tuple[int, dict[str, object], str]:
    out = tmp_path / "summary.json"
    with Processes(tmp_path / "procs") as procs:
        engine = start_engine(
            procs, "sglang", "--kind", "sglang", "--eos-probability", "0", *sim_flags, token_delay_ms=2.0
        )
        done = subprocess.run(
            [sys.executable, str(DRIVER), "--engine-url", engine.url, "--out", str(out), "--hang-s", "30"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    return done.returncode, json.loads(out.read_text()), done.stdout + done.stderr


@pytest.mark.parametrize("incremental", [False, True])
def test_every_check_passes_against_the_simulator_as_a_server(tmp_path: Path, incremental: bool) -> None:
    flags = ["--enable-deterministic-inference"] + (["--incremental-streaming-output"] if incremental else [])
    code, summary, output = run_driver(tmp_path, *flags)
    checks = summary["checks"]
    assert isinstance(checks, list)
    assert [c["name"] for c in checks] == CHECKS
    statuses = {c["name"]: c["status"] for c in checks}
    assert statuses == {**dict.fromkeys(CHECKS, "passed"), "multimodal_ids": "skipped"}, output
    assert all(set(c) == {"name", "status", "detail"} and c["detail"] for c in checks)
    assert summary["passed"] is True and code == 0
    details = {c["name"]: c["detail"] for c in checks}
    assert details["logprob_definition"] == "temperature_scaled_logprobs"
    assert "tiny-qwen2vl" in str(details["multimodal_ids"])  # skipped, saying why


def test_a_simulator_without_deterministic_inference_fails_the_seed_check(tmp_path: Path) -> None:
    code, summary, output = run_driver(tmp_path)
    checks = summary["checks"]
    assert isinstance(checks, list)
    failed = {c["name"]: c["detail"] for c in checks if c["status"] == "failed"}
    assert list(failed) == ["seed_honoured"], output
    assert "--enable-deterministic-inference" in failed["seed_honoured"]
    assert summary["passed"] is False and code == 1
