"""The capability check reads a real vLLM 0.32 engine correctly (the simulator follows it)."""

from __future__ import annotations

import pytest

from tests.harness import harness

pytestmark = pytest.mark.vllm


async def test_real_dense_engine_is_classified(vllm_dense_url: str) -> None:
    async with harness("vllm", engine_url=vllm_dense_url) as h:
        info = await h.client.server_info()
        (engine,) = info.engines
        caps = engine.capabilities
        assert caps.scale_out is True and caps.dev_mode is True
        # The tier starts vLLM without --logprobs-mode, so vLLM's default shows, with a warning.
        assert caps.logprobs_mode == "raw_logprobs"
        assert any("--logprobs-mode processed_logprobs" in w for w in engine.warnings)
        assert caps.moe is False
        assert caps.max_model_len > 0 and caps.model
        assert engine.usable and not engine.problems


async def test_real_engine_with_raw_logprobs_is_refused_when_asked(vllm_dense_url: str) -> None:
    async with harness("vllm", engine_url=vllm_dense_url, raw_logprobs="refuse") as h:
        (engine,) = (await h.client.server_info()).engines
        assert not engine.usable
        assert any("--raw-logprobs warn" in p for p in engine.problems)
