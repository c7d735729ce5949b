"""A trainer's burst: N calls sent at once from a process of their own, their status codes counted.

`python -m tests.support.burst TARGET {generate,info} N [--timeout S]` prints one JSON object:
`{"codes": {"OK": n, ...}, "retry_hint_missing": k, "elapsed_s": t}`. The callers run in their own
process (as a trainer does) so that the replica's event loop, not the test's client, is what the
burst loads; one channel carries every call (one HTTP/2 connection, as a trainer's client has).

A refusal must carry the retry hint (`grpc-retry-pushback-ms`): `retry_hint_missing` counts the
RESOURCE_EXHAUSTED answers that lack it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from typing import TYPE_CHECKING

import grpc

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.stubs import async_stub

if TYPE_CHECKING:
    from rollout_grpc._proto.rollout_pb2_grpc import RolloutServiceAsyncStub

PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301]


async def _generate(stub: RolloutServiceAsyncStub, i: int, timeout: float) -> tuple[str, bool]:
    """One tiny Generate: (status name, whether a refusal lacked its retry hint)."""
    request = pb.GenerateRequest(
        request_id=f"burst-{i}",
        sample=pb.Sample(tokens=PROMPT, index=i),
        sampling_params=pb.SamplingParams(max_new_tokens=2, ignore_eos=True),
    )
    call = stub.Generate(request, timeout=timeout)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, _hint_missing(exc.code(), exc.trailing_metadata())
    return "OK", False


async def _info(stub: RolloutServiceAsyncStub, i: int, timeout: float) -> tuple[str, bool]:
    try:
        await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, _hint_missing(exc.code(), exc.trailing_metadata())
    return "OK", False


def _hint_missing(code: grpc.StatusCode, trailers: object) -> bool:
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    return not any(key == "grpc-retry-pushback-ms" for key, _ in (trailers or ()))  # type: ignore[attr-defined]


async def burst(target: str, method: str, calls: int, timeout: float) -> dict[str, object]:
    """Send `calls` calls at once on one channel; count their status codes."""
    one = _generate if method == "generate" else _info
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout)
        stub = async_stub(channel)
        started = time.monotonic()
        results = await asyncio.gather(*(one(stub, i, timeout) for i in range(calls)))
        elapsed = time.monotonic() - started
    codes = collections.Counter(code for code, _ in results)
    return {
        "codes": dict(codes),
        "retry_hint_missing": sum(1 for _, missing in results if missing),
        "elapsed_s": round(elapsed, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target")
    parser.add_argument("method", choices=["generate", "info"])
    parser.add_argument("calls", type=int)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(burst(args.target, args.method, args.calls, args.timeout))))


if __name__ == "__main__":
    main()
