"""The metrics port has no authentication: its engine series carry the labels non-admins see,
never the engine URLs (internal addresses, some of routes trainers must never reach), unless the
operator asks for them with `--metrics-engine-urls`."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from rollout_grpc.server.security.redact import engine_label
from tests.harness import running_server, sim_engines

pytestmark = pytest.mark.timeout(60)


async def _scrape(**config: Any) -> tuple[str, str]:
    async with sim_engines(1) as sims, running_server([sims[0].url], metrics_port=0, **config) as server:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert resp.status == 200
            return sims[0].url, await resp.text()


async def test_metrics_name_engines_by_label_not_url() -> None:
    url, text = await _scrape()
    netloc = url.removeprefix("http://")
    assert f'rollout_grpc_engine_usable{{engine="{engine_label(url)}"}} 1.0' in text
    assert netloc not in text


async def test_engine_urls_in_metrics_only_when_asked() -> None:
    url, text = await _scrape(metrics_engine_urls=True)
    assert f'rollout_grpc_engine_usable{{engine="{url}"}} 1.0' in text
