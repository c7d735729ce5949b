"""`rollout-grpc`: run a replica (`serve`) or a demo rollout on embedded simulated engines (`demo`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import structlog

from rollout_grpc import logs
from rollout_grpc.server.app import RolloutServer, ServerConfig
from rollout_grpc.server.domain import GenerateOptions

log = structlog.get_logger("rollout_grpc.cli")


def _read_engines_file(path: str) -> list[str]:
    """One engine URL per line; blank lines and # comments are ignored."""
    lines = Path(path).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", action="append", default=[], help="vLLM base URL (repeatable)")
    parser.add_argument("--engines-file", help="file with one engine URL per line; re-read on SIGHUP")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    parser.add_argument("--health-port", type=int, default=0, help="separate grpc.health.v1 port (0 = any)")
    parser.add_argument(
        "--sim-engines", type=int, default=2, help="simulated engines when no --engine is given"
    )
    parser.add_argument(
        "--sim-token-delay-ms", type=float, default=0.0, help="per-token delay of simulated engines"
    )
    parser.add_argument(
        "--server-concurrency", type=int, default=512, help="in-flight generations per engine"
    )
    parser.add_argument("--rollout-num-gpus", type=int, default=None)
    parser.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    parser.add_argument("--max-queue", type=int, default=4096, help="generations that may wait for a slot")
    parser.add_argument(
        "--grace", type=float, default=30.0, help="seconds in-flight generations get at shutdown"
    )
    parser.add_argument("--health-interval", type=float, default=2.0)
    parser.add_argument("--stream-batch-tokens", type=int, default=16)
    parser.add_argument("--stream-batch-interval-ms", type=float, default=200.0)
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        help="another replica (host:port), or dns:///name:port resolved to every replica at each abort",
    )
    parser.add_argument("--max-connection-age", type=float, default=300.0, help="seconds; 0 disables")
    parser.add_argument(
        "--no-engine-stream-interval",
        action="store_true",
        help="never ask engines for stream_interval batching (for engines that reject it)",
    )
    parser.add_argument("--port-file", help="write {grpc, health, engines} as JSON once serving")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", choices=("json", "console"), default="json")


@contextlib.asynccontextmanager
async def _engines(args: argparse.Namespace) -> AsyncIterator[list[str]]:
    """The engine URLs: given ones, or simulated engines started in this process."""
    urls = list(args.engine)
    if args.engines_file:
        urls += _read_engines_file(args.engines_file)
        if not urls:
            # Never fall back to toy engines in a deployment whose engine list came out empty.
            raise SystemExit(f"rollout-grpc: {args.engines_file} lists no engine URL")
    if urls:
        yield urls
        return
    from rollout_grpc.sim import SimConfig, SimEngine

    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                SimEngine(SimConfig(token_delay_s=args.sim_token_delay_ms / 1000, seed=i))
            )
            for i in range(max(1, args.sim_engines))
        ]
        yield [s.url for s in sims]


def _config(args: argparse.Namespace, engines: list[str]) -> ServerConfig:
    return ServerConfig(
        engines=engines,
        host=args.host,
        port=args.port,
        health_port=args.health_port,
        server_concurrency=args.server_concurrency,
        rollout_num_gpus=args.rollout_num_gpus,
        rollout_num_gpus_per_engine=args.rollout_num_gpus_per_engine,
        max_queue=args.max_queue,
        grace_s=args.grace,
        health_interval_s=args.health_interval,
        peers=list(args.peer),
        engine_stream_interval=not args.no_engine_stream_interval,
        max_connection_age_s=args.max_connection_age or None,
        default_options=GenerateOptions(
            stream_batch_tokens=args.stream_batch_tokens,
            stream_batch_interval_s=args.stream_batch_interval_ms / 1000,
        ),
    )


def _reload_engines(server: RolloutServer, args: argparse.Namespace) -> None:
    """SIGHUP: re-read the engines file; new engines join, missing ones drain and leave, and the
    admission limit follows. Without an engines file there is nothing to reload: log and serve on
    (SIGHUP's default action would kill the replica and cut every stream without its sample)."""
    if not args.engines_file:
        log.info("sighup_ignored", reason="no --engines-file to reload")
        return
    try:
        urls = list(args.engine) + _read_engines_file(args.engines_file)
    except OSError as exc:
        log.error("engines_file_unreadable", path=args.engines_file, error=str(exc))
        return
    if not urls:
        log.error("engines_file_empty", path=args.engines_file, action="kept the current engines")
        return
    server.reload_engines(urls)


async def _serve(args: argparse.Namespace) -> int:
    async with _engines(args) as engines:
        server = RolloutServer(_config(args, engines))
        await server.start()
        if args.port_file:
            tmp = args.port_file + ".tmp"
            Path(tmp).write_text(
                json.dumps({"grpc": server.port, "health": server.health_port, "engines": engines})
            )
            os.replace(tmp, args.port_file)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload_engines(server, args))
        await stop.wait()
        log.info("shutdown_requested")
        await server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rollout-grpc` console script."""
    parser = argparse.ArgumentParser(prog="rollout-grpc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one service replica")
    _add_server_arguments(serve)
    demo = sub.add_parser("demo", help="start a replica on simulated engines and run a demo rollout")
    demo.add_argument("--prompts", type=int, default=8)
    demo.add_argument("--samples-per-prompt", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.command == "serve":
        logs.configure(args.log_level, args.log_format)
        return asyncio.run(_serve(args))
    from rollout_grpc.demo import run_demo

    logs.configure("warning", "console")
    return asyncio.run(run_demo(args.prompts, args.samples_per_prompt, args.max_new_tokens))


if __name__ == "__main__":
    sys.exit(main())
