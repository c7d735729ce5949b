"""The ~zero-CPU engine of `bench/workers.py`: nginx serving a stream recorded from the simulator.

Why a test: the worker-count benchmark is only meaningful if the service really generates
through this engine — passes its capability check and health probes, and turns the recorded
SSE stream into complete samples with a logprob per token — on every worker. A benchmark that
silently counted failed calls (or zero-token samples) as throughput would measure nothing.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import load, static_engine
from rollout_grpc.client import AsyncRolloutClient, pb
from tests.support.processes import Processes, nginx_binary, start_replica

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(
        nginx_binary() is None, reason="nginx is not installed (apt-get install nginx-light; .ci/run does it)"
    ),
]

MAX_TOKENS = 256


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    with Processes(tmp_path_factory.mktemp("static-engine")) as procs:
        yield procs


@pytest.fixture(scope="module")
def engines(group: Processes) -> static_engine.StaticEngines:
    return static_engine.start(group, engines=2, max_tokens=MAX_TOKENS, stream_interval=16)


def recorded_tokens(root: Path) -> list[int]:
    """The token ids of the recorded generate stream, in order."""
    tokens: list[int] = []
    for line in (root / static_engine.GENERATE).read_text().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                tokens.extend(choice.get("token_ids") or [])
    return tokens


def test_nginx_answers_a_generate_post_with_the_recorded_event_stream(
    engines: static_engine.StaticEngines, group: Processes
) -> None:
    body = json.dumps(static_engine.generate_body(MAX_TOKENS, 16)).encode()
    request = urllib.request.Request(
        f"{engines.urls[0]}/{static_engine.GENERATE}",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        stream = resp.read().decode()
    assert stream.rstrip().endswith("data: [DONE]")
    assert len(recorded_tokens(group.workdir / "static" / "root")) == MAX_TOKENS


@pytest.mark.parametrize("workers", [1, 2])
def test_generate_through_the_service_returns_complete_samples_with_logprobs(
    engines: static_engine.StaticEngines, group: Processes, workers: int
) -> None:
    replica = start_replica(
        group, f"svc-w{workers}", engines.urls, ["--log-level", "warning", "--workers", str(workers)]
    )
    expected = recorded_tokens(group.workdir / "static" / "root")

    async def generate() -> tuple[list[pb.Sample], pb.GetServerInfoResponse]:
        async with AsyncRolloutClient(replica.target, connections=4) as client:
            samples = []
            for i in range(8):  # the first calls measure the engine's speed, later ones batch
                sample, params, options = load.grpc_request_parts(list(range(3, 67)), MAX_TOKENS)
                options.skip_text = False
                samples.append(await client.generate(sample, params, options, request_id=f"static-{i}"))
            return samples, await client.server_info()

    samples, info = asyncio.run(generate())
    assert info.workers == (workers if workers > 1 else 0)  # `--workers 1` is the plain single process
    assert all(e.usable for e in info.engines)
    assert [list(e.problems) for e in info.engines] == [[], []]
    for sample in samples:
        assert sample.status == pb.SAMPLE_STATUS_TRUNCATED  # max_new_tokens reached, not an error
        assert sample.response_length == MAX_TOKENS
        assert list(sample.tokens[-MAX_TOKENS:]) == expected
        assert len(sample.rollout_log_probs) == MAX_TOKENS
        assert all(lp <= 0.0 for lp in sample.rollout_log_probs)
