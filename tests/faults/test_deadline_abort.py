"""A caller's deadline keeps every token the engine generated (issue 34 item 10).

The client's default `generate()` asks for the final sample only, so the replica asks the engine
for 64 tokens per stream event (`final_only_stream_interval`). Before the fix, the replica closed
the engine stream at the deadline's margin: the engine aborted the request on the disconnect, and
what it had buffered never arrived (20 ms/token, 1 s deadline: ABORTED with 1 token while the
engine had made 44). Now the engine call is aborted upstream shortly before
(`rollout/deadline.py`), the engine answers with its final chunk, and the sample carries every
token, on vLLM's and on SGLang's simulator, with the engine's stream interval on and off.

The tokens are compared with the simulator's own count of what it generated
(`SimStats.generation_tokens_total`, one request per engine here) and, being greedy, with an
uninterrupted greedy reference of the same prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from rollout_grpc.client import make_sample, pb
from tests.faults.support import PROMPT, Outcome, greedy
from tests.harness import harness

Record = Callable[[str, list[Outcome], list[int]], None]

#: Simulated compute per token: the deadline ends the generation long before its budget.
TOKEN_DELAY_S = 0.02
#: Long enough for the margins to be well above a loaded machine's scheduling delays
#: (stop point 300 ms before the deadline, upstream abort 300 ms before that).
DEADLINE_S = 3.0
BUDGET = 2000


@pytest.mark.parametrize("backend", ["sim", "sim-sglang"])
@pytest.mark.parametrize("interval", [True, False], ids=["stream-interval-on", "stream-interval-off"])
async def test_a_final_only_generate_past_its_deadline_keeps_every_token_the_engine_made(
    backend: str, interval: bool, record: Record
) -> None:
    async with harness(backend, sim_config={"eos_probability": 0.0}, engine_stream_interval=interval) as h:
        (engine,) = h.sims
        reference = await h.client.generate(make_sample(PROMPT), greedy(BUDGET))  # at full speed
        engine.config.token_delay_s = TOKEN_DELAY_S
        engine.core.reset_stats()
        out = Outcome("deadline-final-only")
        began = time.monotonic()
        try:
            out.final = await h.client.generate(make_sample(PROMPT), greedy(BUDGET), timeout=DEADLINE_S)
            out.finals = 1
        except grpc.aio.AioRpcError as exc:
            out.error = exc
        elapsed = time.monotonic() - began
        out.engine_made = engine.stats.generation_tokens_total
    fault = f"{backend}: final_only Generate, caller's {DEADLINE_S:g} s deadline, stream interval " + (
        "on" if interval else "off"
    )
    record(fault, [out], list(reference.tokens[len(PROMPT) :]))
    assert out.final is not None
    assert out.final.status == pb.SAMPLE_STATUS_ABORTED, pb.SampleStatus.Name(out.final.status)
    assert out.final.failure_reason == "the caller's deadline is about to expire"
    # The engine was buffering (more than one 64-token event) and every token it made is here.
    assert 64 < out.engine_made < BUDGET
    assert out.final.response_length == out.engine_made
    assert len(out.final.rollout_log_probs) == out.engine_made
    assert elapsed < DEADLINE_S
