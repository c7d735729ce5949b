"""The slime hook's scenarios (groups, over-sampling, abort-all, continuation, pause/resume with
versions) on each backend: the simulator under `make test`, real vLLM under `make test-vllm`.

The scenarios live in tests/client/slime_scenarios.py (also run by the client matrix).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from PIL import Image

from rollout_grpc.client import UnavailableError
from rollout_grpc.integrations import slime
from tests.client.slime_scenarios import SCENARIOS, SLIME_PARAMS, slime_args
from tests.client.slime_types import Sample
from tests.harness import Harness, harness
from tests.support.multimodal import vl

#: Per-token delay of the simulated engines: long generations are still running when the scenario
#: aborts them, short ones finish in tens of milliseconds (real vLLM has its own pace).
SIM_TOKEN_DELAY_S = 0.002


@pytest.fixture
async def replica(backend: str, engine_url: str | None) -> AsyncIterator[Harness]:
    async with harness(backend, engine_url, sim_config={"token_delay_s": SIM_TOKEN_DELAY_S}) as running:
        yield running


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
async def test_slime_hook(replica: Harness, scenario: Callable[[str], Awaitable[None]]) -> None:
    await scenario(replica.target)


async def test_image_sample_generates_aborts_and_continues(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """slime's image sample (a PIL image filling the prompt's image part) is rendered by the service,
    and its continuation re-renders from the sample's own fields: nothing is stashed."""
    async with vl(backend, request, token_delay_s=SIM_TOKEN_DELAY_S) as h:
        args = slime_args(h.target)
        image = Image.new("RGB", (56, 56), (200, 30, 30))
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
        sample = Sample(index=0, prompt=prompt, multimodal_inputs={"images": [image]}, session_id="img-1")
        long = {**SLIME_PARAMS, "max_new_tokens": 200, "ignore_eos": True}
        task = asyncio.ensure_future(slime.generate(args, sample, dict(long)))
        deadline = time.monotonic() + 30
        while (await h.client.server_info()).in_flight < 1:  # until the call is on an engine
            assert time.monotonic() < deadline, "the generate call never got in flight"
            await asyncio.sleep(0.005)
        # Abort(all) pauses the engines in abort mode, which clears vLLM's multimodal cache: the
        # continuation must still generate (the service resends the image's tensors).
        try:
            await slime.abort_all(args)
        except UnavailableError as exc:
            # The contract when an engine's pause does not confirm in time (vLLM pauses between
            # engine steps; docs/engines.md): an answer before the caller's deadline naming the
            # engine, never DEADLINE_EXCEEDED; the stream still ends ABORTED with its tokens.
            assert h.server.config.engines[0] in str(exc) and "/pause?mode=abort" in str(exc), str(exc)
        first = await asyncio.wait_for(task, 30)
        assert first.status is Sample.Status.ABORTED and first.tokens
        before = list(first.tokens)
        again = await slime.generate(args, first, dict(long))
        reason = getattr(again, "rollout_grpc_failure_reason", "")
        assert again.status is Sample.Status.TRUNCATED and again.response_length == 200, reason
        assert again.tokens[: len(before)] == before
        assert len(again.loss_mask or []) == 200 == len(again.rollout_log_probs or [])
        assert again.multimodal_inputs == {"images": [image]} and again.prompt == prompt
