"""`rollout-grpc demo` (`make run`): its table counts each phase's own tokens."""

from __future__ import annotations

import re

import pytest

from rollout_grpc.client import pb
from rollout_grpc.demo import phases, run_demo


def _sample(index: int, status: pb.SampleStatus.ValueType, length: int) -> pb.Sample:
    return pb.Sample(index=index, status=status, response_length=length)


def test_phase_two_counts_only_the_tokens_generated_in_it() -> None:
    round1 = [
        _sample(0, pb.SAMPLE_STATUS_TRUNCATED, 32),
        _sample(1, pb.SAMPLE_STATUS_ABORTED, 10),
        _sample(2, pb.SAMPLE_STATUS_ABORTED, 0),
    ]
    continued = [_sample(1, pb.SAMPLE_STATUS_TRUNCATED, 32), _sample(2, pb.SAMPLE_STATUS_COMPLETED, 5)]
    first, second, final = phases(round1, continued, round1_s=1.0, round2_s=0.5)
    assert first.tokens == 42
    assert second.tokens == (32 - 10) + 5  # not 37: sample 1 brought 10 tokens from phase 1
    assert final.tokens == 32 + 32 + 5 == first.tokens + second.tokens
    assert f"| {54:>9} |" in second.row()  # 27 tokens in 0.5 s


@pytest.mark.parametrize("sim_sglang", [0, 1], ids=["vllm", "mixed-vllm-sglang"])
async def test_demo_table_adds_up(capsys: pytest.CaptureFixture[str], sim_sglang: int) -> None:
    """With `make run`'s sizes some samples are still running at the abort and are continued
    (`make run`; `rollout-grpc demo --sim-sglang 1` on a mixed vLLM + SGLang fleet)."""
    assert await run_demo(prompts=8, samples_per_prompt=4, max_new_tokens=128, sim_sglang=sim_sglang) == 0
    rows = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^\| (\S.*?) +\| +(\d+) \|[^|]*\| +(\d+) \|", capsys.readouterr().out, re.M)
    }
    (_, first), (continued, second), (_, final) = (
        rows[k] for k in ("1: generate, abort-all", "2: continue aborted", "final")
    )
    assert continued > 0
    assert first + second == final
