"""The slime hook's scenarios (groups, over-sampling, abort-all, continuation, pause/resume with
versions) on each backend: the simulator under `make test`, real vLLM under `make test-vllm`.

The scenarios live in tests/client/slime_scenarios.py (also run by the client matrix).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from tests.client.slime_scenarios import SCENARIOS
from tests.harness import Harness, harness

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
