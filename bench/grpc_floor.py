"""What grpc.aio itself costs a server per streaming call and per message: the floor under the service.

Why: issue 26 asks for <= 5 us of service CPU per streamed token at 20 ms/token and 512 streams,
and for Abort(all) within 1.5x of the engine's own. Before cutting more of our own code it must be
known what a server that does *nothing but* grpc.aio costs for the same call shape. This bench
runs a bare grpc.aio server in its own process: one unary-stream method that reads one request
and writes `messages` pre-serialized `GenerateResponse` deltas of `tokens_per_message` tokens,
`interval_ms` apart (asyncio.sleep between writes, as the service is woken between engine
events), then ends with status OK. No protobuf parsing, no HTTP, no engines, no bookkeeping. The
client (this process, grpc.aio, `--connections` channels) runs a closed loop of `--concurrency`
calls and checks that every call got exactly `messages` messages. The server's CPU (psutil, user +
system, all its threads: the event loop and grpc's completion-queue poller) over the run is the
floor.

    python -m bench.grpc_floor --concurrency 512 --requests 1024 --messages 17 --interval-ms 300
    python -m bench.grpc_floor --concurrency 64 --requests 2048 --messages 1 --interval-ms 0

Prints one line per repetition and, with `--tokens-per-sample`, the floor in the unit of
`docs/benchmarks.md` (service CPU seconds per million tokens of samples that size).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench import load, procs
from bench.run import SystemCpu
from rollout_grpc._proto import rollout_pb2 as pb

#: The bare server's streaming method (any path will do: nothing routes on it).
METHOD = "/floor.v1.Floor/Stream"
#: Streams that send one delta, then wait until `RELEASE_METHOD` is called and end with a sample.
HELD_METHOD = "/floor.v1.Floor/Held"
RELEASE_METHOD = "/floor.v1.Floor/Release"
#: A request is four little-endian uint32: messages, interval in microseconds, tokens per message,
#: and the alignment quantum in microseconds (0: none).
_REQUEST = struct.Struct("<IIII")


def delta_payload(tokens: int) -> bytes:
    """A serialized `GenerateResponse` delta of `tokens` tokens, as the service sends one."""
    delta = pb.TokenDelta(token_ids=range(1000, 1000 + tokens), logprobs=[-0.5] * tokens, offset=0)
    return pb.GenerateResponse(delta=delta).SerializeToString()


# ------------------------------------------------------------------------------------- the server


async def _stream(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
    messages, interval_us, tokens, quantum_us = _REQUEST.unpack(request)
    payload = delta_payload(tokens)
    loop = asyncio.get_running_loop()
    quantum = quantum_us / 1e6
    for i in range(messages):
        if i and interval_us:
            if quantum:
                # Wake at the last multiple of the quantum before the interval is up: every call's
                # timer due in one quantum fires in the same loop turn, so their writes go out
                # together (each gap is up to one quantum shorter than the interval).
                now = loop.time()
                await asyncio.sleep((now + interval_us / 1e6) // quantum * quantum - now)
            else:
                await asyncio.sleep(interval_us / 1e6)
        yield payload


class _Held:
    """Streams that wait for one release, as generations wait for an Abort(all): the abort floor."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = 0
        #: What a held stream ends with: an ABORTED sample of two tokens, pre-serialized.
        sample = pb.Sample(status=pb.SAMPLE_STATUS_ABORTED, tokens=[1, 2, 3], response_length=2)
        self.final = pb.GenerateResponse(sample=sample).SerializeToString()

    async def stream(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        release = self.release  # a stream waits for the release after which it started
        self.waiting += 1
        try:
            yield delta_payload(1)
            await release.wait()
        finally:
            self.waiting -= 1
        yield self.final

    async def release_all(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        """End every held stream; answers how many were held (uint32)."""
        count = self.waiting
        self.release.set()
        self.release = asyncio.Event()
        return struct.pack("<I", count)


async def start_server() -> tuple[grpc.aio.Server, int]:
    """The bare methods, served on a free loopback port (returned with the server)."""
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 20)])
    held = _Held()
    handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        METHOD.rsplit("/", 1)[1]: grpc.unary_stream_rpc_method_handler(_stream),
        HELD_METHOD.rsplit("/", 1)[1]: grpc.unary_stream_rpc_method_handler(held.stream),
        RELEASE_METHOD.rsplit("/", 1)[1]: grpc.unary_unary_rpc_method_handler(held.release_all),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(METHOD.rsplit("/", 1)[0].strip("/"), handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def serve(port_file: Path) -> None:
    """Serve until killed; the port number goes to `port_file` (by rename: never read half-written)."""
    server, port = await start_server()
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.rename(port_file)
    await server.wait_for_termination()


# ------------------------------------------------------------------------------------- the client


def _channels(target: str, connections: int) -> list[grpc.aio.Channel]:
    """`connections` channels that do not share a connection (each its own subchannel pool)."""
    return [
        grpc.aio.insecure_channel(
            target, options=[("grpc.channel_id", i), ("grpc.use_local_subchannel_pool", 1)]
        )
        for i in range(connections)
    ]


@dataclass(frozen=True, slots=True)
class FloorRun:
    """One closed loop of calls: its wall time and each call's time to its first message."""

    wall_s: float
    first_message_s: list[float]  # sorted

    def first_message_percentile(self, q: float) -> float:
        return self.first_message_s[min(len(self.first_message_s) - 1, int(q * len(self.first_message_s)))]


async def run_calls(
    target: str,
    concurrency: int,
    requests: int,
    messages: int,
    interval_ms: float,
    tokens: int,
    connections: int,
    align_ms: float = 0.0,
) -> FloorRun:
    """A closed loop of `requests` calls, `concurrency` at a time.

    Raises when a call fails or gets another number of messages than asked for.
    """
    channels = _channels(target, connections)
    calls: list[grpc.aio.UnaryStreamMultiCallable[bytes, bytes]] = [
        ch.unary_stream(METHOD) for ch in channels
    ]
    request = _REQUEST.pack(messages, int(interval_ms * 1000), tokens, int(align_ms * 1000))
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < requests:
            index = next_index
            next_index += 1
            got = 0
            began = time.perf_counter()
            async for _ in calls[index % connections](request):
                if not got:
                    first.append(time.perf_counter() - began)
                got += 1
            if got != messages:
                raise RuntimeError(f"call {index}: {got} messages, asked for {messages}")

    first: list[float] = []
    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        for ch in channels:
            await ch.close()
    return FloorRun(time.perf_counter() - start, sorted(first))


async def abort_floor(target: str, in_flight: int, connections: int = 1) -> load.AbortResult:
    """`in_flight` held streams, each past its first message, then one release: the time from the
    release call to the last stream's end, as `bench.abort_all` times the service's Abort(all)."""
    channels = _channels(target, connections)
    held_calls: list[grpc.aio.UnaryStreamMultiCallable[bytes, bytes]] = [
        ch.unary_stream(HELD_METHOD) for ch in channels
    ]
    release: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channels[0].unary_unary(RELEASE_METHOD)
    started = asyncio.Event()
    count = 0
    done_at: list[float] = []

    async def one(index: int) -> str:
        nonlocal count
        got = 0
        async for _ in held_calls[index % connections](b""):
            got += 1
            if got == 1:
                count += 1
                if count == in_flight:
                    started.set()
        done_at.append(time.perf_counter())
        return "aborted" if got == 2 else f"{got} messages"

    tasks = [asyncio.create_task(one(i)) for i in range(in_flight)]
    try:
        await asyncio.wait_for(started.wait(), 60.0)
        t0 = time.perf_counter()
        held = struct.unpack("<I", await release(b"", timeout=60.0))[0]
        call = time.perf_counter() - t0
        finishes = await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
    finally:
        for task in tasks:
            task.cancel()
        for ch in channels:
            await ch.close()
    if held != in_flight:
        raise RuntimeError(f"the release found {held} held streams, expected {in_flight}")
    return load.abort_result(in_flight, t0, call, done_at, finishes, "aborted")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the server child's port file
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--messages", type=int, default=17, help="messages per call (deltas + final)")
    parser.add_argument("--interval-ms", type=float, default=300.0, help="between a call's messages")
    parser.add_argument("--tokens-per-message", type=int, default=16)
    parser.add_argument(
        "--align-ms",
        type=float,
        default=0.0,
        help="wake each call's next write at a multiple of this many ms (0: each call's own phase)",
    )
    parser.add_argument("--tokens-per-sample", type=int, default=256, help="for the s/Mtok figure")
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    for name in ("concurrency", "requests", "messages", "connections", "reps", "tokens_per_sample"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    with (
        tempfile.TemporaryDirectory(prefix="grpc-floor-") as workdir,
        procs.Processes(Path(workdir)) as group,
    ):
        # The server is a child like the benchmarks' engines and replicas: started, waited for
        # through its port file and stopped by the group.
        port_file = procs.fresh_port_file(Path(workdir) / "port")
        server = group.start(
            "floor", [sys.executable, "-m", "bench.grpc_floor", "--serve", str(port_file)], cwd=procs.REPO
        )
        target = f"127.0.0.1:{procs.read_port_file(port_file, server)}"
        # Warm-up: connections, the server's first calls.
        asyncio.run(run_calls(target, 16, 32, 1, 0, args.tokens_per_message, args.connections))
        per_call: list[float] = []
        for rep in range(args.reps):
            machine = SystemCpu()
            with procs.Meter({"server": server.popen.pid}, interval_s=0.5) as meter:
                run = asyncio.run(
                    run_calls(
                        target,
                        args.concurrency,
                        args.requests,
                        args.messages,
                        args.interval_ms,
                        args.tokens_per_message,
                        args.connections,
                        args.align_ms,
                    )
                )
            wall = run.wall_s
            server_s = meter.cpu_s["server"]
            per_call.append(server_s / args.requests)
            print(
                f"rep {rep}: {args.requests} calls x {args.messages} messages in {wall:.2f} s; "
                f"server CPU {server_s:.2f} s = {server_s / args.requests * 1e6:,.0f} us/call, "
                f"{server_s / (args.requests * args.messages) * 1e6:,.1f} us/message; "
                f"first message p50 {run.first_message_percentile(0.5) * 1000:.1f} ms, "
                f"p99 {run.first_message_percentile(0.99) * 1000:.1f} ms; "
                f"machine busy {machine.elapsed() / wall:.2f} cores",
                flush=True,
            )
    median = statistics.median(per_call)
    print(
        f"median {median * 1e6:,.0f} us of server CPU per call of {args.messages} messages = "
        f"{median / args.tokens_per_sample * 1e6:.1f} s/Mtok for {args.tokens_per_sample}-token samples "
        f"(pid {os.getpid()} was the client)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
