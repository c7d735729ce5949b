"""The command line: simulated engines only when asked, `sim` and `info` subcommands."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_grpc import __version__, cli, settings
from rollout_grpc.info import run_info
from rollout_grpc.server.app import ServerConfig
from tests.harness import harness
from tests.support.processes import Processes, child_env, read_port_file, replica_command
from tests.support.sglang_http import sglang_engine

#: `rollout-grpc info`'s deadline in the tests of a wrong target: each is answered at once (a
#: refused connection, UNIMPLEMENTED, an HTTP/1 reply), so a safety net, not the bound under test;
#: a deadline a loaded machine overruns would print DEADLINE_EXCEEDED instead of the hint checked.
INFO_S = 30.0


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


def test_serve_without_engines_fails_and_says_how_to_fix_it() -> None:
    result = subprocess.run(
        [*replica_command(), "serve", "--port", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in child_env().items() if not k.startswith("ROLLOUT_GRPC_")},
    )
    assert result.returncode != 0
    assert "no engine given" in result.stderr
    assert "--engine" in result.stderr and "--sim N" in result.stderr


def test_serve_with_sim_is_loud_and_flagged(procs: Processes, tmp_path: Path) -> None:
    port_file = tmp_path / "ports.json"
    proc = procs.start(
        "replica",
        [*replica_command(), "serve", "--sim", "1", "--port", "0", "--port-file", str(port_file)],
    )
    ports = json.loads(read_port_file(port_file, proc))
    target = f"127.0.0.1:{ports['grpc']}"
    assert "SIMULATED ENGINES" in proc.log_text()
    info = subprocess.run(
        [*replica_command(), "info", "--target", target, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    body = json.loads(info.stdout)
    assert body["simulatedEngines"] is True
    assert body["health"] == "SERVING"
    assert len(body["engines"]) == 1 and body["engines"][0]["usable"] is True


def test_sim_subcommand_has_help() -> None:
    out = subprocess.run(
        [*replica_command(), "sim", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.startswith("usage: rollout-grpc sim")
    assert "--no-scale-out" in out and "--logprobs-mode" in out


async def test_info_prints_a_table_with_problems(capsys: pytest.CaptureFixture[str]) -> None:
    async with harness("sim", sim_count=1, sim_config={"dev_mode": False}) as h:
        # run_info uses a blocking channel: run it off the event loop that serves the replica.
        code = await asyncio.to_thread(run_info, h.target)
    out = capsys.readouterr().out
    assert code == 1  # the only engine is unusable: the replica is NOT_SERVING
    assert "health NOT_SERVING" in out
    assert h.sims[0].url in out
    assert "PROBLEM" in out and "VLLM_SERVER_DEV_MODE=1" in out


def test_info_on_an_unreachable_target_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_info("127.0.0.1:1", timeout=INFO_S) == 2
    assert "UNAVAILABLE" in capsys.readouterr().err


async def test_info_on_another_port_of_the_replica_says_which_port_to_ask(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The usual mistakes: the health port (gRPC without RolloutService), an engine's HTTP port,
    a URL. Each is exit 2 with one line that says what it is and what to ask instead."""
    async with harness("sim", sim_count=1) as h:
        health = f"127.0.0.1:{h.server.health_port}"
        engine = h.sims[0].url.removeprefix("http://")
        codes = [
            await asyncio.to_thread(run_info, t, timeout=INFO_S) for t in (health, engine, h.sims[0].url)
        ]
    err = capsys.readouterr().err.splitlines()
    assert codes == [2, 2, 2]
    assert "UNIMPLEMENTED" in err[0] and "the replica's health port? ask its --port" in err[0]
    assert "an HTTP/1 server answers here" in err[1]
    assert (
        err[2]
        == f"rollout-grpc info: target {h.sims[0].url!r} is a URL; a gRPC target is host:port: {engine!r}"
    )


def _parsers(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`parser` and every parser below it, each with its command path."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_subcommand_and_flag_has_help() -> None:
    """`--help` is the reference an operator reads: no flag may be listed bare."""
    parser, _ = cli.build_parser()
    tree = dict(_parsers(parser, "rollout-grpc"))
    assert set(tree) >= {f"rollout-grpc {c}" for c in ("serve", "sim", "info", "demo")}
    bare: list[str] = []
    for path, node in tree.items():
        if not node.description:
            bare.append(f"{path} (no description)")
        for action in node._actions:
            if isinstance(action, argparse._SubParsersAction):
                bare += [f"{path} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help or action.help == argparse.SUPPRESS:
                bare.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not bare, f"without help: {bare}"
    # The sim subcommand's tree node carries the simulator's real flags (not an empty stub).
    assert "--logprobs-mode" in tree["rollout-grpc sim"].format_help()


def test_every_numeric_flag_of_every_command_has_a_range() -> None:
    """A bare `type=int` or `float` takes -5 for a port and nan for a timeout (`argtypes.number`)."""
    parser, _ = cli.build_parser()
    bare = [
        f"{path} {'/'.join(action.option_strings)}"
        for path, node in _parsers(parser, "rollout-grpc")
        for action in node._actions
        if action.type in (int, float) and action.choices is None
    ]
    assert not bare, f"numeric flags without a range: {bare}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["info", "--timeout", "-1"], "argument --timeout: must be greater than 0, got -1"),
        (["info", "--timeout", "nan"], "argument --timeout: must be a finite number, got 'nan'"),
        (["demo", "--prompts", "0"], "argument --prompts: must be at least 1, got 0"),
        (["demo", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be at least 1, got -1"),
        (["sim", "--port", "99999"], "argument --port: must be at most 65535, got 99999"),
        (["sim", "--eos-probability", "2"], "argument --eos-probability: must be at most 1, got 2"),
        (["sim", "--vocab-size", "8"], "argument --vocab-size: must be at least 264, got 8"),
        (["sim", "--token-delay-ms", "-5"], "argument --token-delay-ms: must not be negative, got -5"),
    ],
)
def test_numbers_out_of_range_are_one_line_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `info --timeout -1` reported the replica DEADLINE_EXCEEDED, `demo --prompts 0` ran
    nothing and said ok, `sim --port 99999` ended in a traceback."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_no_command_takes_a_shortened_flag() -> None:
    """argparse's prefix matching read `serve --engines URL` as `--engines-file URL`; subparsers do
    not inherit `allow_abbrev=False` from their parent, so each parser of the tree is checked."""
    parser, _ = cli.build_parser()
    abbreviating = [path for path, node in _parsers(parser, "rollout-grpc") if node.allow_abbrev]
    assert not abbreviating, f"parsers that match flag prefixes: {abbreviating}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Before: read as --engines-file, then "engines file http://x:1: No such file or directory".
        (
            ["serve", "--engines", "http://x:1"],
            "unrecognized arguments: --engines http://x:1; did you mean --engine?",
        ),
        # Before: "ambiguous option: --max could match ..." under 70 lines of usage.
        (["serve", "--max", "3"], "unrecognized arguments: --max 3"),
        # Before: taken as --config by the pre-parser that finds the config file.
        (
            ["serve", "--conf", "x.toml", "--sim", "1"],
            "unrecognized arguments: --conf x.toml; did you mean --config?",
        ),
        # Before: taken as --timeout.
        (["info", "--tim", "3"], "unrecognized arguments: --tim 3; did you mean --timeout?"),
        (["demo", "--prompt", "3"], "unrecognized arguments: --prompt 3; did you mean --prompts?"),
        (["sim", "--por", "3"], "unrecognized arguments: --por 3; did you mean --port?"),
        # Before: "the following arguments are required: command", not naming the flag.
        (["--vers"], "unrecognized arguments: --vers; did you mean --version?"),
        ([], "no command given: serve, sim, info or demo"),
    ],
)
def test_an_unknown_or_shortened_flag_is_one_line_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.splitlines()) == 1, err  # no usage block above it


def test_every_serve_flag_sits_in_a_named_section_of_its_help() -> None:
    """`serve --help` listed 77 flags in one section; each now sits in one of settings.FLAG_GROUPS."""
    _, serve = cli.build_parser()
    titles = [title for title, _ in settings.FLAG_GROUPS]
    section_of = {
        option: group.title
        for group in serve._action_groups
        for action in group._group_actions
        for option in action.option_strings
    }
    flags = ["--config", *(flag.name for flag in settings.FLAGS)]
    outside = [flag for flag in flags if section_of[flag] not in titles]
    assert not outside, f"serve flags outside the named sections: {outside}"
    listed = [name for _, names in settings.FLAG_GROUPS for name in names]
    assert sorted(listed) == sorted(flags), "FLAG_GROUPS must name every serve flag exactly once"
    help_text = serve.format_help()
    assert all(f"\n{title}:\n" in help_text for title in titles)
    assert len(help_text.split("\n\n")[0].splitlines()) == 1  # the usage line, not 70 lines of flags


def test_version_flag_prints_the_package_version() -> None:
    result = subprocess.run(
        [*replica_command(), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == f"rollout-grpc {__version__}"


def test_info_targets_the_local_replica_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_GRPC_INFO_TARGET", raising=False)
    parser, _ = cli.build_parser()
    assert f"127.0.0.1:{ServerConfig(engines=[]).port}" == cli.LOCAL_TARGET
    assert parser.parse_args(["info"]).target == cli.LOCAL_TARGET
    monkeypatch.setenv("ROLLOUT_GRPC_INFO_TARGET", "10.0.0.7:6000")
    parser, _ = cli.build_parser()
    assert parser.parse_args(["info"]).target == "10.0.0.7:6000"


async def test_info_into_a_closed_pipe_exits_quietly() -> None:
    """`rollout-grpc info --json | head -1`: the reader may leave before the output is written.

    The pipe's read end is closed before the child starts, so its first write meets EPIPE every
    time (a reader that leaves after one line would race the child's write into the pipe buffer).
    """
    async with harness("sim", sim_count=1) as h:
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            result = await asyncio.to_thread(
                subprocess.run,
                [*replica_command(), "info", "--target", h.target, "--json"],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 0  # what the command would have returned: the replica is SERVING


async def test_serve_drives_an_sglang_engine_and_info_names_its_kind(
    procs: Processes, tmp_path: Path
) -> None:
    """`serve --engine sglang+http://...`: the replica speaks SGLang to it (usable, SERVING) and
    `info` shows the kind per engine, in JSON and in the table."""
    async with sglang_engine() as eng:
        port_file = tmp_path / "ports.json"
        proc = procs.start(
            "replica",
            [
                *replica_command(),
                "serve",
                "--engine",
                f"sglang+{eng.url}",
                "--port",
                "0",
                "--port-file",
                str(port_file),
            ],
        )
        ports = json.loads(await asyncio.to_thread(read_port_file, port_file, proc))
        target = f"127.0.0.1:{ports['grpc']}"
        assert ports["engines"] == [eng.url]  # the base URL, without the kind prefix
        args = [*replica_command(), "info", "--target", target]
        as_json = await asyncio.to_thread(
            subprocess.run, [*args, "--json"], capture_output=True, text=True, timeout=60, check=True
        )
        table = await asyncio.to_thread(
            subprocess.run, args, capture_output=True, text=True, timeout=60, check=True
        )
        requests = eng.core.stats.generate_requests
    body = json.loads(as_json.stdout)
    assert body["health"] == "SERVING"
    (engine,) = body["engines"]
    assert engine["kind"] == "sglang" and engine["usable"] is True
    row = next(line for line in table.stdout.splitlines() if eng.url in line)
    assert "sglang" in row.split()
    assert requests == 0  # info asked the replica, which asked the engine's control routes only
