"""`rollout-grpc serve`: one replica, or (`--workers N`) a supervisor of N worker processes.

Needs the `server` extra: `rollout_grpc.cli` imports this module only for `serve`, so that the
client-only install runs `--help`, `--version` and `info`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import structlog

from rollout_grpc import logs, settings
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.server.exposure import ExposureRefused
from rollout_grpc.server.ports import PortUnavailable
from rollout_grpc.server.rollout import collector
from rollout_grpc.server.state.api import StoreUnavailable

log = structlog.get_logger("rollout_grpc.cli")


@contextlib.asynccontextmanager
async def _engines(
    args: argparse.Namespace, given: list[settings.EngineURL]
) -> AsyncIterator[tuple[list[str], dict[str, str]]]:
    """The engine URLs and the kinds of those that are not vLLM: the given ones, or (only with
    --sim N) simulated vLLM engines in this process."""
    urls = [engine.url for engine in given]
    if args.engines_file and not urls:
        # Never fall back to toy engines in a deployment whose engine list came out empty.
        raise SystemExit(f"rollout-grpc: {args.engines_file} lists no engine URL")
    if urls and args.sim:
        raise SystemExit("rollout-grpc: give engines (--engine/--engines-file) or --sim N, not both")
    if urls:
        yield urls, settings.engine_kinds(given)
        return
    if not args.sim:
        raise SystemExit(
            "rollout-grpc serve: no engine given. Pass --engine URL (repeatable) or --engines-file FILE "
            "(or ROLLOUT_GRPC_ENGINE / ROLLOUT_GRPC_ENGINES_FILE); --sim N runs N simulated engines "
            "for demos and tests"
        )
    from rollout_grpc.sim import SimConfig, SimEngine

    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                # Configured as the README says to start vLLM (processed logprobs).
                SimEngine(
                    SimConfig(
                        token_delay_s=args.sim_token_delay_ms / 1000,
                        seed=i,
                        logprobs_mode="processed_logprobs",
                    )
                )
            )
            for i in range(args.sim)
        ]
        log.warning(
            "simulated_engines",
            engines=[s.url for s in sims],
            note="SIMULATED ENGINES (--sim): toy tokens, not a model; never train on them",
        )
        yield [s.url for s in sims], {}


def _reload_engines(server: RolloutServer, args: argparse.Namespace) -> None:
    """SIGHUP: re-read the engines file; new engines join, missing ones drain and leave, and the
    admission limit follows. Without an engines file there is nothing to reload: log and serve on
    (SIGHUP's default action would kill the replica and cut every stream without its sample)."""
    if not args.engines_file:
        log.info("sighup_engines_unchanged", reason="no --engines-file to reload")
        return
    engines = _engines_now(args, "kept the current engines")
    if engines is not None:
        server.reload_engines([engine.url for engine in engines], settings.engine_kinds(engines))


def _engines_now(args: argparse.Namespace, action: str) -> list[settings.EngineURL] | None:
    """The engines as the flags and the engines file say now; None (logged, with `action`) when the
    file is unreadable, has a bad line (named by its number) or lists no engine."""
    try:
        engines = settings.engine_list(args)
    except settings.SettingsError as exc:
        log.error("engines_file_invalid", path=args.engines_file, error=str(exc), action=action)
        return None
    if not engines:
        log.error("engines_file_empty", path=args.engines_file, action=action)
        return None
    return engines


def _on_sighup(server: RolloutServer, args: argparse.Namespace) -> None:
    """SIGHUP: re-read the engines file (when given) and the tokens file."""
    _reload_engines(server, args)
    server.reload_credentials()


async def _serve(args: argparse.Namespace, given: list[settings.EngineURL]) -> int:
    async with _engines(args, given) as (engines, kinds):
        try:
            config = settings.server_config(args, engines, simulated=bool(args.sim), kinds=kinds)
        except settings.SettingsError as exc:
            raise SystemExit(f"rollout-grpc serve: {exc}") from None
        try:
            config.tls()  # TLS flags that do not go together
            server = RolloutServer(config)  # an unusable tokens file
        except ValueError as exc:
            raise SystemExit(f"rollout-grpc serve: {exc}") from None
        try:
            await server.start()
        except (ExposureRefused, StoreUnavailable) as exc:  # refused before anything was bound
            raise SystemExit(f"rollout-grpc serve: {exc}") from None
        except PortUnavailable as exc:
            await server.stop()
            raise SystemExit(f"rollout-grpc serve: {exc}") from None
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # Before the port file says "serving": SIGHUP's default action would kill the replica.
        loop.add_signal_handler(signal.SIGHUP, lambda: _on_sighup(server, args))
        # What exists now lives as long as the process: frozen out of the collector's scans.
        frozen, threshold = collector.settle_after_start()
        log.info("collector_settled", frozen_objects=frozen, gen0_threshold=threshold)
        if args.port_file:
            tmp = args.port_file + ".tmp"
            Path(tmp).write_text(
                json.dumps(
                    {
                        "grpc": server.port,
                        "health": server.health_port,
                        "openai": server.openai_port,
                        "metrics": server.metrics_port,
                        "engines": engines,
                    }
                )
            )
            os.replace(tmp, args.port_file)
        await stop.wait()
        log.info("shutdown_requested")
        await server.stop()
    return 0


def _worker_count(args: argparse.Namespace) -> int:
    """`--workers`, or the cores this process may run on."""
    from rollout_grpc.server.workers.supervisor import default_workers

    if args.workers is None:
        return default_workers()
    return int(args.workers)  # at least 1 (settings.AT_LEAST_ONE)


async def _supervise(
    args: argparse.Namespace, given: list[settings.EngineURL], argv: list[str], workers: int
) -> int:
    """`serve --workers N` (N > 1): this process supervises N workers on one port (docs/workers.md)."""
    from rollout_grpc.server.workers.supervisor import Supervisor, SupervisorError

    async with _engines(args, given) as (engines, kinds):
        try:
            config = settings.server_config(args, engines, simulated=bool(args.sim), kinds=kinds)
        except settings.SettingsError as exc:
            raise SystemExit(f"rollout-grpc serve: {exc}") from None
        supervisor = Supervisor(config, workers, argv, simulated=bool(args.sim), port_file=args.port_file)
        try:
            return await supervisor.run()
        except SupervisorError as exc:
            raise SystemExit(f"rollout-grpc serve: {exc}") from None


async def _serve_worker(args: argparse.Namespace, channel: socket.socket) -> int:
    """One worker of a `serve --workers N` supervisor (workers/worker.py)."""
    from rollout_grpc.server.workers import handshake
    from rollout_grpc.server.workers.worker import WorkerServer, serve_worker, worker_config

    spec = handshake.read_spec(channel)
    structlog.contextvars.bind_contextvars(worker=spec.index)
    engines, kinds = spec.engines, spec.engine_kinds
    if args.engines_file and not spec.simulated:
        # A worker started after the file changed (a replacement) serves what it says now, as its
        # siblings do after their SIGHUP; the supervisor's list is the file as it was at its start.
        current = _engines_now(args, "serving the engines the replica started with")
        if current is not None:
            engines, kinds = [engine.url for engine in current], settings.engine_kinds(current)
    try:
        config = settings.server_config(args, engines, simulated=spec.simulated, kinds=kinds)
        server = WorkerServer(worker_config(config, spec), spec)
    except (settings.SettingsError, ValueError) as exc:
        channel.sendall(handshake.encode({"error": str(exc)}))
        return 1
    return await serve_worker(server, channel, lambda: _on_sighup(server, args))


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The parsed `serve` command (`argv`: its arguments after `serve`, handed to the workers)."""
    from rollout_grpc.server.workers.handshake import worker_socket

    channel = worker_socket()
    if channel is not None:  # started by a `serve --workers N` supervisor, which read the engines
        logs.configure(args.log_level, args.log_format)
        return asyncio.run(_serve_worker(args, channel))
    try:
        given = settings.engine_list(args)
    except settings.SettingsError as exc:
        print(f"rollout-grpc serve: error: {exc}", file=sys.stderr)
        return 2
    logs.configure(args.log_level, args.log_format)
    for unknown in settings.unknown_variables(os.environ):
        log.warning(
            "environment_variable_ignored",
            variable=unknown.name,
            did_you_mean=unknown.meant,
            flag=unknown.flag,
            message=str(unknown),
        )
    workers = _worker_count(args)
    if workers > 1:
        return asyncio.run(_supervise(args, given, argv, workers))
    return asyncio.run(_serve(args, given))
