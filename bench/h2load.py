"""A load generator that costs ~no CPU: gRPC Generate calls driven by h2load (nghttp2, in C).

Why: on a 2-core machine the Python gRPC load generator costs 0.44-0.6 of the service's CPU per
token (docs/workers.md), so it takes the core a second worker is meant to use. h2load speaks
HTTP/2 cleartext with prior knowledge, which is what gRPC without TLS is: every call is a POST to
`/rollout.v1.RolloutService/Generate` with `content-type: application/grpc`, `te: trailers` and a
body that is one gRPC frame (a 5-byte header: uncompressed flag, big-endian length; then the
serialized `GenerateRequest`). The request id is left empty, so the service gives every call its
own (`uuid4`), and the same body serves every call.

h2load does not read gRPC trailers: a call that fails with a gRPC status is still an HTTP 200 for
it. So a run counts as done only when the service agrees (`verify`): its metrics (the supervisor's
merged scrape with `--workers N`) must show, between a scrape before and one after, exactly one
`Generate` handled with code OK per call, and `max_tokens` generated tokens per call; and the
response bytes h2load received must be the call count times one call's expected size (measured once
with the Python client, `expected_response_bytes`), within a small tolerance for the varint-sized
fields (timings) that differ between calls.
"""

from __future__ import annotations

import random
import re
import resource
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench import load
from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client import AsyncRolloutClient

PACKAGE = "nghttp2-client"
GENERATE_PATH = "/rollout.v1.RolloutService/Generate"
#: Allowed difference between the bytes received and calls x one call's size (varint fields).
BYTES_TOLERANCE = 0.02


class H2loadMissing(RuntimeError):
    """h2load is not installed."""


def binary() -> str:
    """The h2load executable, or a clear error naming the package that has it."""
    path = shutil.which("h2load")
    if path is None:
        raise H2loadMissing(
            f"--client h2load needs h2load on PATH: install the {PACKAGE} package "
            f"(Debian/Ubuntu: apt-get install -y {PACKAGE})"
        )
    return path


def grpc_frame(message: bytes) -> bytes:
    """One uncompressed gRPC length-prefixed message."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def generate_request(max_tokens: int, final_only: bool, seed: int = 0) -> pb.GenerateRequest:
    """The bench's request (`load.grpc_request_parts`), with no request id (the service assigns one)."""

    sample, params, options = load.grpc_request_parts(
        load.prompt(random.Random(seed)), max_tokens, final_only
    )
    return pb.GenerateRequest(sample=sample, sampling_params=params, options=options)


def write_request_file(path: Path, max_tokens: int, final_only: bool) -> Path:
    """The body h2load sends on every call."""
    path.write_bytes(grpc_frame(generate_request(max_tokens, final_only).SerializeToString()))
    return path


async def expected_response_bytes(target: str, max_tokens: int, final_only: bool) -> int:
    """The DATA bytes of one successful call's response (every message with its 5-byte header)."""
    async with AsyncRolloutClient(target) as client:
        request = generate_request(max_tokens, final_only)
        total = 0
        async for message in client.generate_stream(
            request.sample, request.sampling_params, request.options, request_id="x" * 32
        ):
            total += 5 + message.ByteSize()
    return total


@dataclass
class Counts:
    """What the service's metrics say it did: Generate calls by gRPC code, tokens generated."""

    generate_by_code: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0

    def minus(self, before: Counts) -> Counts:
        codes = set(self.generate_by_code) | set(before.generate_by_code)
        return Counts(
            {c: self.generate_by_code.get(c, 0.0) - before.generate_by_code.get(c, 0.0) for c in codes},
            self.tokens - before.tokens,
        )


def scrape(metrics_port: int) -> Counts:
    """The replica's Generate outcomes and tokens, summed over its workers."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    counts = Counts()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rollout_grpc_grpc_server_handled_total" and (
                sample.labels.get("grpc_method") == "Generate"
            ):
                code = sample.labels.get("grpc_code", "")
                counts.generate_by_code[code] = counts.generate_by_code.get(code, 0.0) + sample.value
            elif sample.name == "rollout_grpc_generation_tokens_total":
                counts.tokens += sample.value
    return counts


@dataclass
class H2loadRun:
    """One h2load run: what it reported, each call's latency, its own CPU."""

    wall_s: float
    started: int
    succeeded: int
    failed: int
    errored: int
    data_bytes: int
    latencies_s: list[float]
    cpu_s: float
    output: str


_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored"
)
_TRAFFIC = re.compile(r"traffic: .*, \S+ \((\d+)\) data")


def command(
    target: str, data_file: Path, requests: int, concurrency: int, connections: int, log_file: Path
) -> list[str]:
    """h2load's arguments: `connections` TCP connections, `concurrency / connections` streams each."""
    conns = min(connections, concurrency)
    if concurrency % conns:
        raise ValueError(
            f"--concurrency {concurrency} must be a multiple of --connections {conns} with --client h2load "
            "(h2load opens the same number of streams on every connection)"
        )
    return [
        binary(),
        "-n",
        str(requests),
        "-c",
        str(conns),
        "-m",
        str(concurrency // conns),
        "-t",
        "1",
        "-d",
        str(data_file),
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        "--log-file",
        str(log_file),
        f"http://{target}{GENERATE_PATH}",
    ]


def run(argv: list[str], log_file: Path) -> H2loadRun:
    """Run h2load to its end; its CPU comes from the kernel's accounting of finished children."""
    log_file.unlink(missing_ok=True)  # h2load appends to its log file
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"h2load exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    requests = _REQUESTS.search(done.stdout)
    traffic = _TRAFFIC.search(done.stdout)
    if requests is None or traffic is None:
        raise RuntimeError(f"unexpected h2load output:\n{done.stdout}")
    latencies = [
        int(line.split("\t")[2]) / 1e6 for line in log_file.read_text().splitlines() if line.count("\t") >= 2
    ]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return H2loadRun(
        wall_s=wall,
        started=int(requests.group(2)),
        succeeded=int(requests.group(4)),
        failed=int(requests.group(5)),
        errored=int(requests.group(6)),
        data_bytes=int(traffic.group(1)),
        latencies_s=latencies,
        cpu_s=cpu,
        output=done.stdout,
    )


def verify(result: H2loadRun, counted: Counts, requests: int, max_tokens: int, call_bytes: int) -> list[str]:
    """Why the run does not prove every call succeeded (empty: it does)."""
    problems = []
    if len(result.latencies_s) != requests:
        problems.append(f"h2load logged {len(result.latencies_s)} calls, expected {requests}")
    if result.succeeded != requests or result.failed or result.errored:
        problems.append(
            f"h2load: {result.succeeded} of {requests} succeeded, {result.failed} failed, "
            f"{result.errored} errored"
        )
    ok = counted.generate_by_code.get("OK", 0.0)
    other = {c: n for c, n in counted.generate_by_code.items() if c != "OK" and n}
    if ok != requests or other:
        problems.append(f"service metrics: {ok:.0f} Generate OK of {requests}, others {other}")
    if counted.tokens != requests * max_tokens:
        problems.append(f"service metrics: {counted.tokens:.0f} tokens, expected {requests * max_tokens}")
    expected = requests * call_bytes
    if abs(result.data_bytes - expected) > BYTES_TOLERANCE * expected:
        problems.append(f"h2load received {result.data_bytes} response bytes, expected ~{expected}")
    return problems
