"""Shared fixtures. Scenario tests take `backend` and run on the simulator and on real vLLM."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.harness import Harness, harness

pytest_plugins = ["tests.vllm.fixtures"]

BACKENDS = [pytest.param("sim", id="sim"), pytest.param("vllm", id="vllm", marks=pytest.mark.vllm)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The engine backend of a scenario test: "sim" (make test) or "vllm" (make test-vllm)."""
    return str(request.param)


@pytest.fixture
def engine_url(request: pytest.FixtureRequest, backend: str) -> str | None:
    """The dense vLLM server's URL for the vllm backend (None for the simulator)."""
    if backend == "vllm":
        return str(request.getfixturevalue("vllm_dense_url"))
    return None


@pytest.fixture
async def h(backend: str, engine_url: str | None) -> AsyncIterator[Harness]:
    """A replica and client on one engine of the backend."""
    async with harness(backend, engine_url) as running:
        yield running
