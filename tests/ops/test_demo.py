"""`rollout-grpc demo` (`make run`): its table counts each phase's own tokens."""

from __future__ import annotations

import re

import pytest

from rollout_grpc.client import pb
from rollout_grpc.demo import abort_summary, phases, run_demo


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


def test_the_footer_counts_the_aborted_samples_as_the_table_does() -> None:
    """`make run` printed "abort-all ended 14" under a table of 13 aborted samples: the replica's
    count includes a generation its engine finished at the moment of the abort (COMPLETED)."""
    round1 = [_sample(i, pb.SAMPLE_STATUS_ABORTED, 10) for i in range(13)]
    round1.append(_sample(13, pb.SAMPLE_STATUS_COMPLETED, 20))
    line = abort_summary(14, round1)
    assert line.startswith("abort-all ended 13 in-flight generations as ABORTED")
    assert "the replica was ending 14; 1 finished at that moment with their own status" in line
    assert line.endswith("; 13 continued with their remaining budget.")
    assert abort_summary(13, round1[:13]).startswith("abort-all ended 13 in-flight generations as ABORTED;")


@pytest.mark.parametrize("sim_sglang", [0, 1], ids=["vllm", "mixed-vllm-sglang"])
async def test_demo_table_adds_up(capsys: pytest.CaptureFixture[str], sim_sglang: int) -> None:
    """With `make run`'s sizes some samples are still running at the abort and are continued
    (`make run`; `rollout-grpc demo --sim-sglang 1` on a mixed vLLM + SGLang fleet)."""
    assert await run_demo(prompts=8, samples_per_prompt=4, max_new_tokens=128, sim_sglang=sim_sglang) == 0
    out = capsys.readouterr().out
    rows = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^\| (\S.*?) +\| +(\d+) \|[^|]*\| +(\d+) \|", out, re.M)
    }
    table_aborted = re.search(r"^\| 1: generate, abort-all .*?aborted (\d+)", out, re.M)
    footer = re.search(r"^abort-all ended (\d+) in-flight generations as ABORTED", out, re.M)
    assert table_aborted and footer and table_aborted.group(1) == footer.group(1), out
    (_, first), (continued, second), (_, final) = (
        rows[k] for k in ("1: generate, abort-all", "2: continue aborted", "final")
    )
    assert continued > 0
    assert first + second == final
