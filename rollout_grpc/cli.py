"""`rollout-grpc`: run a replica (`serve`), a simulated engine (`sim`), inspect a replica (`info`) or
run a demo rollout on embedded simulated engines (`demo`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from rollout_grpc import __version__
from rollout_grpc import info as info_command
from rollout_grpc.argtypes import CommandParser, number

#: The commands that run server code (aiohttp, structlog, ...): the `server` extra on Python 3.11.
#: The others (`--help`, `--version`, `info`) need only the client's dependencies, so that the
#: client-only install (`pip install rollout-grpc`) can inspect a replica.
SERVER_COMMANDS = ("serve", "sim", "demo")

#: The address of a replica on this host started with `serve`'s default port (ServerConfig.port;
#: tests/ops/test_cli.py checks that they agree, as this module may not import the server).
LOCAL_TARGET = "127.0.0.1:50051"

_SERVE_DESCRIPTION = (
    "Run one service replica. Every flag can also come from the environment (ROLLOUT_GRPC_<FLAG>) "
    "or a TOML file (--config); precedence: flag > environment > config file > default."
)
_SIM_DESCRIPTION = "A simulated vLLM or SGLang engine (HTTP) for tests: toy tokens, real API."
_DEMO_DESCRIPTION = (
    "Start two simulated engines and a replica in this process, generate with over-sampling "
    "(abort-all once half the samples are done), continue the aborted samples, print a table and "
    "exit (0 when the trainer contract holds). What `make run` runs."
)


def build_parser(*, server: bool = True) -> tuple[CommandParser, CommandParser]:
    """The whole command tree and its `serve` parser (which `settings.parse_serve_args` layers
    environment and config file values into). `sim` carries the simulator's own flags so that
    `rollout-grpc sim --help` and the help test see them, although `main` hands `sim` argv to the
    simulator's parser directly.

    `server=False` builds the tree without the flags of `serve` and `sim`, which are defined by
    server modules: what `--help`, `--version` and `info` need, with the client's dependencies."""
    parser = CommandParser(prog="rollout-grpc", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version and exit"
    )
    # Not `required=True`: argparse would then report a missing command before an unknown flag
    # (`rollout-grpc --vers`: "the following arguments are required: command"); `main` checks it.
    sub = parser.add_subparsers(dest="command", metavar="{serve,sim,info,demo}")
    serve = sub.add_parser(
        "serve",
        help="run one service replica",
        # argparse's generated usage lists all 77 flags (70 lines above the first section).
        usage="%(prog)s (--engine URL ... | --engines-file FILE | --sim N) [options]",
        description=_SERVE_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sim_help = "run one simulated engine, vLLM or (--kind sglang) SGLang (see `rollout-grpc sim --help`)"
    if server:
        from rollout_grpc import settings
        from rollout_grpc.sim.__main__ import build_parser as sim_parser

        settings.add_serve_arguments(serve)
        simulator = sim_parser("rollout-grpc sim")
        sub.add_parser(
            "sim",
            help=sim_help,
            description=simulator.description,
            parents=[simulator],
            add_help=False,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    else:
        sub.add_parser("sim", help=sim_help, description=_SIM_DESCRIPTION)
    info = sub.add_parser(
        "info",
        help="show a replica and its engines (GetServerInfo) as a table",
        description=info_command.DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    info_command.add_arguments(info, default_target=LOCAL_TARGET)
    demo = sub.add_parser(
        "demo",
        help="start a replica on simulated engines and run a demo rollout",
        description=_DEMO_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    at_least_one = number(int, low=1)
    demo.add_argument("--prompts", type=at_least_one, default=8, help="prompt groups to generate")
    demo.add_argument("--samples-per-prompt", type=at_least_one, default=4, help="samples per prompt group")
    demo.add_argument("--max-new-tokens", type=at_least_one, default=128, help="token budget of each sample")
    demo.add_argument("--progress", action="store_true", help="show a progress bar (tqdm)")
    demo.add_argument(
        "--sim-sglang",
        type=int,
        choices=(0, 1, 2),
        default=0,
        metavar="N",
        help="make N of the two simulated engines SGLang (1: a mixed vLLM + SGLang fleet)",
    )
    return parser, serve


def _server_problem(command: str) -> str | None:
    """Why `command` cannot run in this interpreter (no `server` extra, another Python), or None.

    Importing `rollout_grpc.server` runs its environment check (server/environment.py), which
    names every missing dependency and the install command."""
    try:
        import rollout_grpc.server  # noqa: F401
    except RuntimeError as exc:
        return f"rollout-grpc {command}: {exc}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rollout-grpc` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    if command in SERVER_COMMANDS:
        problem = _server_problem(command)
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
    if command == "sim":
        from rollout_grpc.sim.__main__ import main as sim_main

        sim_main(argv[1:], prog="rollout-grpc sim")
        return 0
    if command == "serve":
        from rollout_grpc import serve_command, settings

        _, serve = build_parser()
        args = settings.parse_serve_args(serve, argv[1:])
        args.command = "serve"
        return serve_command.run(args, argv[1:])
    parser, _ = build_parser(server=False)  # serve and sim were handed over above
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("no command given: serve, sim, info or demo")
    if args.command == "info":
        try:
            security = info_command.security_from_args(args)
        except (OSError, ValueError) as exc:
            print(f"rollout-grpc info: {exc}", file=sys.stderr)
            return 2
        return info_command.run_info(args.target, as_json=args.json, timeout=args.timeout, security=security)
    from rollout_grpc import logs
    from rollout_grpc.demo import run_demo

    logs.configure("warning", "console")
    return asyncio.run(
        run_demo(
            args.prompts,
            args.samples_per_prompt,
            args.max_new_tokens,
            progress=args.progress,
            sim_sglang=args.sim_sglang,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
