"""Several simulated vLLM engines in one process: `python -m bench.sim_pool --engines K --port-file F ...`.

Why: the scale benchmark (`bench/scale.py`) needs up to 32 engines on a 2-core machine. 32
`python -m rollout_grpc.sim` processes would be 32 interpreters (tens of MiB each) competing for
two cores; the simulator's `SimEngine` is an ordinary asyncio object, so K of them can share one
event loop, each on its own port, exactly as `rollout-grpc sim` configures one (the flags are the
simulator's own, parsed by its parser). To the service each is an independent engine: its own
port, its own request table, its own `/health`. Engine `i` of the pool uses `--seed + i`.

The port file receives a JSON list of the bound ports (atomically, by rename) once every engine
listens. SIGTERM/SIGINT stop them all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from rollout_grpc.sim import SimEngine
from rollout_grpc.sim.__main__ import build_parser, config_from_args


async def serve(engines: int, sim_args: list[str], port_file: str) -> None:
    """Start `engines` engines configured by `sim_args`, write their ports, wait for a signal."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    parsed = build_parser().parse_args(sim_args)
    started: list[SimEngine] = []
    try:
        for i in range(engines):
            config = config_from_args(parsed)
            config.seed = parsed.seed + i
            started.append(await SimEngine(config, host=parsed.host).start())
        tmp = Path(f"{port_file}.tmp{os.getpid()}")
        tmp.write_text(json.dumps([e.port for e in started]))  # a few bytes: no need for a thread
        tmp.replace(port_file)
        print(
            f"bench.sim_pool: {engines} engines on {[e.port for e in started]}", file=sys.stderr, flush=True
        )
        await stop.wait()
    finally:
        for engine in started:
            await engine.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_pool", description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, required=True, help="engines in this process")
    parser.add_argument("--port-file", required=True, help="receives a JSON list of the ports")
    args, sim_args = parser.parse_known_args(argv)
    if args.engines < 1:
        parser.error(f"--engines must be at least 1, got {args.engines}")
    asyncio.run(serve(args.engines, sim_args, args.port_file))


if __name__ == "__main__":
    main()
