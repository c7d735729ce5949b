"""Fixtures for the simulator's tests: engines on loopback (with the test-side ``/_sim/*`` routes of
``tests/support/sim_admin.py``), an HTTP session, the golden files."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from rollout_grpc.sim import SimConfig, SimEngine
from tests.support import sim_admin
from tests.support.sim_http import EngineFactory


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@contextlib.asynccontextmanager
async def _engine(**config: Any) -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(**config), extensions=[sim_admin.mount]) as eng:
        yield eng


@pytest.fixture
def make_engine() -> EngineFactory:
    """``async with make_engine(token_delay_s=0.001) as eng:``"""
    return _engine


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    """A default engine that never stops early on its own (``eos_probability=0``)."""
    async with SimEngine(SimConfig(eos_probability=0.0), extensions=[sim_admin.mount]) as eng:
        yield eng


@pytest.fixture
async def tiny_llama() -> AsyncIterator[SimEngine]:
    """Configured like the recorded server: ``tiny-llama`` at ``--max-model-len 512``."""
    cfg = SimConfig(
        model="tiny-llama", model_root="tiny-models/tiny-llama", max_model_len=512, eos_probability=0.0
    )
    async with SimEngine(cfg) as eng:
        yield eng
