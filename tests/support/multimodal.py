"""Multimodal test helpers: a PNG made in the test, a vl harness on either backend, chat and samples."""

from __future__ import annotations

import contextlib
import io
from collections.abc import AsyncIterator

import pytest
from PIL import Image

from rollout_grpc.client import image_part, pb
from tests.harness import Harness, harness


def png(width: int = 56, height: int = 56, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A small PNG made here (no files, no downloads)."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


@contextlib.asynccontextmanager
async def vl(backend: str, request: pytest.FixtureRequest, **sim: object) -> AsyncIterator[Harness]:
    if backend == "sim-sglang":
        # The scenarios start from Render; SGLang's image path (image_data) is tested in
        # tests/integration/test_sglang_adapter.py and tests/integration/test_mixed_fleet.py.
        pytest.skip("SGLang serves no render route: these scenarios render their images first")
    if backend == "sim":
        async with harness("sim", sim_config={"multimodal": True, **sim}) as h:
            yield h
    else:
        async with harness("vllm", str(request.getfixturevalue("vllm_vl_url"))) as h:
            yield h


def chat(image: bytes, text: str = "What is this?") -> list[dict[str, object]]:
    return [{"role": "user", "content": [image_part(image), text]}]


def sample_from(rendered: pb.RenderResponse, session_id: str = "") -> pb.Sample:
    sample = pb.Sample(tokens=rendered.token_ids, status=pb.SAMPLE_STATUS_PENDING, session_id=session_id)
    sample.multimodal_features.CopyFrom(rendered.features)
    return sample
