"""`serve` configuration: one source of defaults; flag > environment > config file > default."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from rollout_grpc import settings
from rollout_grpc.client import make_sample
from rollout_grpc.server.app import ServerConfig
from rollout_grpc.server.config import TOOL_PARSERS, FrontDoorConfig
from rollout_grpc.server.domain.trajectory import DriftPolicy
from rollout_grpc.server.domain.vocabulary import EngineKind
from rollout_grpc.server.front.openai.tools import PARSERS
from tests.harness import harness
from tests.support.processes import child_env, replica_command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="serve")
    settings.add_serve_arguments(parser)
    return parser


def _parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    return settings.parse_serve_args(_parser(), argv, env or {})


def test_every_server_config_field_is_a_flag_or_excluded_with_a_reason() -> None:
    covered = {f.field.split(".")[0] for f in settings.FLAGS if f.field}
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    missing = fields - covered - set(settings.NOT_FLAGS)
    assert not missing, f"ServerConfig fields without a flag: {sorted(missing)}"
    assert all(settings.NOT_FLAGS.values())


def test_every_front_door_field_is_a_flag_or_excluded_with_a_reason() -> None:
    covered = {f.field.removeprefix("openai.") for f in settings.FLAGS if f.field.startswith("openai.")}
    fields = {f.name for f in dataclasses.fields(FrontDoorConfig)}
    assert covered <= fields
    assert not fields - covered - set(settings.NOT_OPENAI_FLAGS)
    assert not covered & set(settings.NOT_OPENAI_FLAGS) and all(settings.NOT_OPENAI_FLAGS.values())


def test_front_door_tool_parser_and_drift_policy_flags(tmp_path: Path) -> None:
    """Every parser and policy the front door knows can be chosen, from any source."""
    by_name = {f.name: f for f in settings.FLAGS}
    assert by_name["--openai-tool-parser"].choices == tuple(sorted(PARSERS))
    assert set(TOOL_PARSERS) == set(PARSERS), "config.TOOL_PARSERS names the door's parsers"
    assert by_name["--openai-drift-policy"].choices == tuple(p.value for p in DriftPolicy)
    cfg = settings.server_config(
        _parse(["--openai-drift-policy", "split", "--openai-tool-parser", "none"]), []
    )
    assert cfg.openai == FrontDoorConfig(drift_policy=DriftPolicy.SPLIT, tool_parser="none")
    assert isinstance(cfg.openai.drift_policy, DriftPolicy)
    env = {"ROLLOUT_GRPC_OPENAI_DRIFT_POLICY": "split"}
    assert settings.server_config(_parse([], env), []).openai.drift_policy is DriftPolicy.SPLIT
    (tmp_path / "c.toml").write_text('openai-tool-parser = "none"\n')
    assert (
        settings.server_config(_parse(["--config", str(tmp_path / "c.toml")]), []).openai.tool_parser
        == "none"
    )


@pytest.mark.parametrize("argv", [["--openai-drift-policy", "rewrite"], ["--openai-tool-parser", "mistral"]])
def test_unknown_front_door_policies_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parse(argv)
    assert exited.value.code == 2
    assert f"argument {argv[0]}: invalid choice: '{argv[1]}'" in capsys.readouterr().err


def test_defaults_come_from_the_dataclasses() -> None:
    parsed = settings.server_config(_parse([]), ["http://e"])
    assert parsed == ServerConfig(engines=["http://e"])


def test_every_flag_has_help_and_shows_its_default_and_variable() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollout_grpc.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    flat = " ".join(out.split())
    for flag in settings.FLAGS:
        assert flag.help, flag.name
        assert flag.env in flat, flag.name
    assert flat.count("(default:") >= len(settings.FLAGS)


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    config = tmp_path / "replica.toml"
    config.write_text('grace = 11.0\nmax-queue = 7\nport = 6000\nengine = ["http://from-file"]\n')
    env = {"ROLLOUT_GRPC_MAX_QUEUE": "8", "ROLLOUT_GRPC_PORT": "6001", "ROLLOUT_GRPC_CONFIG": str(config)}
    args = _parse(["--port", "6002"], env)
    cfg = settings.server_config(args, list(args.engine))
    assert cfg.port == 6002  # flag
    assert cfg.max_queue == 8  # environment
    assert cfg.grace_s == 11.0  # config file
    assert cfg.health_interval_s == ServerConfig(engines=[]).health_interval_s  # default
    assert cfg.engines == ["http://from-file"]


def test_list_flags_replace_rather_than_extend_lower_sources() -> None:
    assert _parse([]).engine == []
    env = {"ROLLOUT_GRPC_ENGINE": "http://a, http://b"}
    assert _parse([], env).engine == ["http://a", "http://b"]
    assert _parse(["--engine", "http://c", "--engine", "http://d"], env).engine == ["http://c", "http://d"]


def test_units_switches_and_none_values_convert() -> None:
    args = _parse(
        ["--stream-batch-interval-ms", "50", "--max-connection-age", "0", "--engine-read-timeout", "0"],
        {"ROLLOUT_GRPC_NO_ENGINE_STREAM_INTERVAL": "true", "ROLLOUT_GRPC_METRICS_PORT": "0"},
    )
    cfg = settings.server_config(args, ["http://e"])
    assert cfg.default_options.stream_batch_interval_s == pytest.approx(0.05)
    assert cfg.max_connection_age_s is None and cfg.engine_read_timeout_s is None
    assert cfg.engine_stream_interval is False
    assert cfg.metrics_port == 0


@pytest.mark.parametrize(
    ("env", "config", "needle"),
    [
        ({"ROLLOUT_GRPC_GRACE": "soon"}, "", "ROLLOUT_GRPC_GRACE"),
        ({"ROLLOUT_GRPC_RAW_LOGPROBS": "maybe"}, "", "--raw-logprobs"),
        ({}, "no_such_flag = 1\n", "unknown key 'no_such_flag'"),
        ({}, "grace = true\n", "--grace"),
        ({}, "grase = 10\n", "unknown key 'grase' (keys are `serve` flag names); did you mean 'grace'?"),
    ],
)
def test_bad_values_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], env: dict[str, str], config: str, needle: str
) -> None:
    argv: list[str] = []
    if config:
        path = tmp_path / "c.toml"
        path.write_text(config)
        argv = ["--config", str(path)]
    with pytest.raises(SystemExit):
        _parse(argv, env)
    assert needle in capsys.readouterr().err


def test_every_bounded_flag_is_a_numeric_flag() -> None:
    numeric = {
        f.name
        for f in settings.FLAGS
        if f.kind == "value" and settings._flag_type(f).__name__ in ("int", "float")
    }
    bounded = settings.AT_LEAST_ONE | settings.ABOVE_ZERO | settings.PORTS
    assert bounded - numeric == set()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--grace", "nan", "must be a finite number, got 'nan'"),
        ("--control-deadline", "inf", "must be a finite number, got 'inf'"),
        ("--max-queue", "-1", "must not be negative, got -1"),
        ("--sim-token-delay-ms", "-0.5", "must not be negative, got -0.5"),
        ("--control-deadline", "0", "must be greater than 0, got 0"),
        ("--engine-idle-timeout", "0", "must be greater than 0, got 0"),
        ("--stream-batch-tokens", "0", "must be at least 1, got 0"),
        ("--server-concurrency", "0", "must be at least 1, got 0"),
        ("--workers", "0", "must be at least 1, got 0"),
        ("--port", "65536", "must be at most 65535, got 65536"),
        ("--openai-port", "-1", "must not be negative, got -1"),
        ("--openai-max-sessions-per-caller", "0", "must be at least 1, got 0"),
        ("--openai-session-mb-per-caller", "0", "must be at least 1, got 0"),
        ("--openai-session-ttl-s", "0", "must be greater than 0, got 0"),
        ("--openai-session-ttl-s", "inf", "must be a finite number, got 'inf'"),
        ("--openai-session-ttl-s", "-5", "must be greater than 0, got -5"),
    ],
)
def test_numbers_no_flag_means_are_refused_from_every_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    """A value outside a flag's range is one error naming the flag and its source, before anything
    starts (a server default of 0 tokens per message would fail every caller's Generate)."""
    by_name = {f.name: f for f in settings.FLAGS}
    with pytest.raises(SystemExit):
        _parse([flag, value])
    assert f"argument {flag}: {message}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse([], {by_name[flag].env: value})
    assert f"environment {by_name[flag].env}: {flag}: {message}" in capsys.readouterr().err
    path = tmp_path / "c.toml"
    path.write_text(f'{flag.removeprefix("--")} = "{value}"\n')
    with pytest.raises(SystemExit):
        _parse(["--config", str(path)])
    assert f"{flag}: {message}" in capsys.readouterr().err


def test_a_reward_url_prefix_must_be_an_http_origin(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--reward-url", "ftp://rm.example"])
    assert (
        "argument --reward-url: 'ftp://rm.example': must be an http(s) URL with a host"
        in capsys.readouterr().err
    )
    assert _parse(["--reward-url", "http://rm:8000/score"]).reward_url == ["http://rm:8000/score"]


def test_an_env_url_prefix_must_be_an_http_origin(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--env-url", "http://user@env:9000"])
    assert "argument --env-url: 'http://user@env:9000': must be scheme://host" in capsys.readouterr().err
    assert _parse(["--env-url", "http://env:9000/step"]).env_url == ["http://env:9000/step"]


@pytest.mark.parametrize(
    ("peer", "problem"),
    [
        ("nonsense", "a peer is host:port or dns:///name:port"),
        ("dns:///rollout-headless", "a peer is host:port or dns:///name:port"),
        ("http://10.0.0.2:50051", "a peer is host:port or dns:///name:port"),
        ("10.0.0.2:99999", "the port must be a number 1-65535, got '99999'"),
    ],
)
def test_a_peer_must_be_an_address_with_a_port(
    peer: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A peer without a port was dialed at 443, and `dns:///name` failed every forwarded abort."""
    with pytest.raises(SystemExit):
        _parse(["--peer", peer])
    assert f"argument --peer: {peer!r}: {problem}" in capsys.readouterr().err
    assert _parse(["--peer", "dns:///rollout-headless:50051", "--peer", "[::1]:50051"]).peer == [
        "dns:///rollout-headless:50051",
        "[::1]:50051",
    ]


def test_the_edges_of_each_range_are_accepted() -> None:
    args = _parse(
        [
            *("--port", "65535", "--health-port", "0", "--grace", "0", "--stream-batch-tokens", "1"),
            *("--control-deadline", "0.01", "--max-queue", "0", "--workers", "1"),
        ]
    )
    assert (args.port, args.health_port, args.grace, args.stream_batch_tokens) == (65535, 0, 0.0, 1)
    assert (args.control_deadline, args.max_queue, args.workers) == (0.01, 0, 1)


async def test_breaker_cooldown_setting_reaches_the_engine_pool() -> None:
    """`--breaker-cooldown` decides how long an engine that broke a stream stays out of rotation."""
    async with harness("sim", breaker_cooldown_s=0.0) as h:
        h.sims[0].faults.drop_connection = 1
        h.sims[0].faults.drop_after_tokens = 0
        # The stream breaks before a token arrives and no other engine is left: UNAVAILABLE, and
        # the engine's breaker is open. (With the default, one token, the sample keeps that token
        # and ends ABORTED: the reader now hands out a chunk that came just before the break.)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await h.client.generate(make_sample([5, 6, 7]), {"max_new_tokens": 50, "ignore_eos": True})
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not h.server.pool.engines[0].usable
        engine = h.server.pool.engines[0]
        # No cooldown: the next successful probe closes the breaker (the default, 5 s, would not).
        await h.server.pool.probe(engine)
        assert engine.usable


async def test_the_session_bound_flags_reach_the_sessions_store() -> None:
    """`--openai-max-sessions-per-caller`, `--openai-session-mb-per-caller` and
    `--openai-session-ttl-s` are the caps the replica's session store applies (they were fields
    set in code only), and a caller over the session cap is refused naming it."""
    argv = [
        *("--openai-max-sessions-per-caller", "1", "--openai-session-mb-per-caller", "3"),
        *("--openai-session-ttl-s", "90.5"),
    ]
    cfg = settings.server_config(_parse(argv), ["http://e:1"])
    assert (cfg.openai.max_sessions, cfg.openai.max_session_mb, cfg.openai.session_ttl_s) == (1, 3, 90.5)
    async with harness("sim", openai=cfg.openai) as h:
        caps = h.server.trajectories.store.trajectory_caps
        assert (caps.max_sessions_per_owner, caps.max_bytes_per_owner, caps.ttl_s) == (1, 3 << 20, 90.5)


def test_misspelt_environment_variables_are_named_with_the_setting_they_probably_meant() -> None:
    env = {
        "ROLLOUT_GRPC_GRASE": "10",
        "ROLLOUT_GRPC_SIM_ENGINES": "2",  # the alias --sim-engines has no variable of its own
        "ROLLOUT_GRPC_ZZZ": "1",
        "ROLLOUT_GRPC_GRACE": "10",
        "ROLLOUT_GRPC_CONFIG": "x.toml",
        "ROLLOUT_GRPC_INFO_TLS_CA": "ca.pem",
        "HOME": "/root",
    }
    unknown = {u.name: u for u in settings.unknown_variables(env)}
    assert set(unknown) == {"ROLLOUT_GRPC_GRASE", "ROLLOUT_GRPC_SIM_ENGINES", "ROLLOUT_GRPC_ZZZ"}
    assert (unknown["ROLLOUT_GRPC_GRASE"].meant, unknown["ROLLOUT_GRPC_GRASE"].flag) == (
        "ROLLOUT_GRPC_GRACE",
        "--grace",
    )
    assert unknown["ROLLOUT_GRPC_SIM_ENGINES"].meant == "ROLLOUT_GRPC_SIM"
    assert unknown["ROLLOUT_GRPC_ZZZ"].meant is None


def test_every_rollout_grpc_variable_the_code_reads_is_known() -> None:
    """A variable read outside the settings table (the slime hook's target, ...) is not a typo."""
    package = Path(settings.__file__).parent.parent  # the whole rollout_grpc package
    names = {
        name
        for path in package.rglob("*.py")
        for name in re.findall(r"ROLLOUT_GRPC_[A-Z0-9_]+", path.read_text())
        if name != settings.ENV_PREFIX
    }
    assert "ROLLOUT_GRPC_TARGET" in names
    assert settings.unknown_variables(dict.fromkeys(names, "")) == []


def test_serve_warns_about_a_misspelt_variable_at_start() -> None:
    env = {k: v for k, v in child_env().items() if not k.startswith("ROLLOUT_GRPC_")}
    result = subprocess.run(
        [*replica_command(), "serve", "--port", "0"],  # no engine: exits once the settings are read
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "ROLLOUT_GRPC_GRASE": "10"},
    )
    assert result.returncode != 0
    warning = next(line for line in result.stderr.splitlines() if "ROLLOUT_GRPC_GRASE" in line)
    assert "environment_variable_ignored" in warning and "ROLLOUT_GRPC_GRACE (--grace)" in warning


@pytest.mark.parametrize(
    ("text", "url", "kind"),
    [
        ("http://vllm-0:8000", "http://vllm-0:8000", EngineKind.VLLM),
        ("  https://vllm.example.com/ ", "https://vllm.example.com", EngineKind.VLLM),
        ("HTTP://[::1]:8000", "http://[::1]:8000", EngineKind.VLLM),
        ("vllm+http://10.0.0.1:8000", "http://10.0.0.1:8000", EngineKind.VLLM),
        ("sglang+https://sgl:30000", "https://sgl:30000", EngineKind.SGLANG),
    ],
)
def test_engine_urls_split_into_a_plain_url_and_a_kind(text: str, url: str, kind: EngineKind) -> None:
    assert settings.parse_engine_url(text) == settings.EngineURL(url, kind)


@pytest.mark.parametrize(
    ("text", "wrong"),
    [
        ("127.0.0.1:8100", "no scheme"),
        ("ftp://h:1", "scheme 'ftp' is not http or https"),
        ("tgi+http://h:1", "unknown engine kind 'tgi'"),
        ("http://:8000", "no host"),
        ("http://h:0", "port"),
        ("http://h:70000", "port"),
        ("http://h:80a", "port"),
        ("http://h:", "port"),
        ("http://h:8000/v1", "path '/v1'"),
        ("http://h:8000/?x=1", "query"),
        ("http://h:8000#top", "fragment"),
        ("http://user:pw@h:8000", "credentials"),
    ],
)
def test_bad_engine_urls_say_what_is_wrong(text: str, wrong: str) -> None:
    with pytest.raises(ValueError, match=re.escape(wrong)):
        settings.parse_engine_url(text)


@pytest.mark.parametrize("source", ["flag", "environment", "config file", "engines file"])
def test_serve_refuses_an_engine_without_a_scheme_in_one_line(tmp_path: Path, source: str) -> None:
    """Refused when the settings are read, naming where the value came from; it used to reach
    aiohttp and end `serve` with a 40-line traceback."""
    bad = "127.0.0.1:8100"
    env = {k: v for k, v in child_env().items() if not k.startswith("ROLLOUT_GRPC_")}
    argv: list[str] = []
    where = {
        "flag": "argument --engine",
        "environment": "environment ROLLOUT_GRPC_ENGINE",
        "config file": "key 'engine'",
        "engines file": "line 3",
    }[source]
    if source == "flag":
        argv = ["--engine", bad]
    elif source == "environment":
        env["ROLLOUT_GRPC_ENGINE"] = f"http://ok:8000,{bad}"
    elif source == "config file":
        (tmp_path / "c.toml").write_text(f'engine = ["{bad}"]\n')
        argv = ["--config", str(tmp_path / "c.toml")]
    else:
        (tmp_path / "engines.txt").write_text(f"# engines\nhttp://ok:8000\n{bad}  # typo\n")
        argv = ["--engines-file", str(tmp_path / "engines.txt")]
    result = subprocess.run(
        [*replica_command(), "serve", *argv], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert where in result.stderr and repr(bad) in result.stderr and "no scheme" in result.stderr


def test_the_sglang_prefix_reaches_the_server_config_from_flag_variable_and_file(tmp_path: Path) -> None:
    """Every way of naming engines carries the kind to `ServerConfig.engine_kinds` (URL -> kind,
    vLLM engines absent), with the plain base URL in `engines`."""
    engines_file = tmp_path / "engines.txt"
    engines_file.write_text("# fleet\nsglang+http://sgl-file:30000\nhttp://vllm-file:8000\n")
    args = _parse(
        ["--engine", "sglang+http://sgl-flag:30000", "--engines-file", str(engines_file)],
        {"ROLLOUT_GRPC_SGLANG_EXPERTS_TOPK": "8"},
    )
    engines = settings.engine_list(args)
    config = settings.server_config(args, [e.url for e in engines], kinds=settings.engine_kinds(engines))
    assert config.engines == ["http://sgl-flag:30000", "http://sgl-file:30000", "http://vllm-file:8000"]
    assert config.engine_kinds == {"http://sgl-flag:30000": "sglang", "http://sgl-file:30000": "sglang"}
    assert config.sglang_experts_topk == 8
    from_env = settings.engine_list(_parse([], {"ROLLOUT_GRPC_ENGINE": "sglang+http://sgl-env:30000"}))
    assert settings.engine_kinds(from_env) == {"http://sgl-env:30000": "sglang"}


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--auth-tokens-file", "/nonexistent/tokens"], "auth tokens file /nonexistent/tokens: No such file"),
        (["--tls-cert", "/nonexistent/cert.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_an_unusable_security_file_or_flag_stops_serve_in_one_line(
    workers: str, flags: list[str], line: str
) -> None:
    """They ended `serve --workers 1` in a traceback (a missing tokens file with any worker count)."""
    env = {k: v for k, v in child_env().items() if not k.startswith("ROLLOUT_GRPC_")}
    result = subprocess.run(
        [*replica_command(), "serve", "--sim", "1", "--port", "0", "--workers", workers, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"rollout-grpc serve: {line}"), result.stderr
