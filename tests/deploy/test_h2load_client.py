"""`bench/workers.py --client h2load`: h2load's calls are real Generates, and a failed one is caught.

Why a test: h2load reads no gRPC trailers, so a call that ended with INVALID_ARGUMENT is an HTTP 200
it counts as succeeded. The benchmark's numbers mean something only if `bench.h2load.verify`
accepts a run exactly when the service says every call returned its sample.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import h2load, static_engine
from rollout_grpc._proto import rollout_pb2 as pb
from tests.support.processes import Processes, Replica, nginx_binary, start_replica

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(
        nginx_binary() is None, reason="nginx is not installed (apt-get install nginx-light; .ci/run does it)"
    ),
    pytest.mark.skipif(
        shutil.which("h2load") is None,
        reason="h2load is not installed (apt-get install nghttp2-client; .ci/run does it)",
    ),
]

MAX_TOKENS = 256
CALLS = 64


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    with Processes(tmp_path_factory.mktemp("h2load")) as procs:
        yield procs


@pytest.fixture(scope="module")
def replica(group: Processes) -> Replica:
    engines = static_engine.start(group, engines=2, max_tokens=MAX_TOKENS, stream_interval=16)
    return start_replica(
        group, "svc", engines.urls, ["--log-level", "warning", "--workers", "2", "--metrics-port", "0"]
    )


def _run(replica: Replica, request_file: Path, log_file: Path) -> tuple[h2load.H2loadRun, h2load.Counts]:
    metrics = int(replica.info["metrics"])
    before = h2load.scrape(metrics)
    result = h2load.run(h2load.command(replica.target, request_file, CALLS, 16, 8, log_file), log_file)
    return result, h2load.scrape(metrics).minus(before)


@pytest.mark.parametrize("final_only", [False, True])
def test_every_h2load_call_is_a_generate_that_returned_its_sample(
    replica: Replica, tmp_path: Path, final_only: bool
) -> None:
    request_file = h2load.write_request_file(tmp_path / "request.grpc", MAX_TOKENS, final_only)
    call_bytes = asyncio.run(h2load.expected_response_bytes(replica.target, MAX_TOKENS, final_only))
    result, counted = _run(replica, request_file, tmp_path / "h2load.log")
    assert h2load.verify(result, counted, CALLS, MAX_TOKENS, call_bytes) == []
    assert counted.generate_by_code == {"OK": CALLS}
    assert result.data_bytes == pytest.approx(CALLS * call_bytes, rel=h2load.BYTES_TOLERANCE)


def test_a_call_the_service_refused_fails_the_run_although_h2load_counts_it_succeeded(
    replica: Replica, tmp_path: Path
) -> None:
    request = h2load.generate_request(MAX_TOKENS, final_only=False)
    request.sampling_params.temperature = -1.0  # INVALID_ARGUMENT, in an HTTP 200 (trailers only)
    request_file = tmp_path / "bad.grpc"
    request_file.write_bytes(h2load.grpc_frame(request.SerializeToString()))
    call_bytes = asyncio.run(h2load.expected_response_bytes(replica.target, MAX_TOKENS, False))
    result, counted = _run(replica, request_file, tmp_path / "h2load.log")
    assert result.succeeded == CALLS  # h2load's view: every call an HTTP 200
    assert counted.generate_by_code.get("OK", 0) == 0
    problems = h2load.verify(result, counted, CALLS, MAX_TOKENS, call_bytes)
    assert any("Generate OK" in p for p in problems)
    assert any("response bytes" in p for p in problems)


def test_the_request_file_is_one_uncompressed_grpc_frame(tmp_path: Path) -> None:
    data = h2load.write_request_file(tmp_path / "r.grpc", MAX_TOKENS, True).read_bytes()
    assert data[0] == 0 and int.from_bytes(data[1:5], "big") == len(data) - 5
    request = pb.GenerateRequest.FromString(data[5:])
    assert request.request_id == ""  # the service gives every call its own id
    assert request.sampling_params.max_new_tokens == MAX_TOKENS and request.options.final_only


def test_streams_that_do_not_divide_over_the_connections_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--concurrency 10 must be a multiple of --connections 4"):
        h2load.command("127.0.0.1:1", tmp_path / "r", 100, 10, 4, tmp_path / "log")
