"""The engines a replica is given: `--engine` URLs and the engines file, each checked when the
settings are read (not at the first HTTP call) and split into its URL and kind (`sglang+http://`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rollout_grpc.server.domain.vocabulary import EngineKind
from rollout_grpc.settings.flag import SettingsError


@dataclass(frozen=True, slots=True)
class EngineURL:
    """One engine: its base URL (a plain `http(s)://host[:port]` string, what `ServerConfig.engines`
    holds) and its kind (`sglang+http://...`; vLLM when there is no prefix)."""

    url: str
    kind: EngineKind = EngineKind.VLLM


_ENGINE_FORM = "expected http(s)://HOST[:PORT], optionally prefixed vllm+ or sglang+"


def parse_engine_url(text: str) -> EngineURL:
    """Check one engine URL and split off its kind; ValueError says what is wrong with it.

    Checked when the settings are read rather than when the first HTTP call fails: `127.0.0.1:8100`
    (no scheme) used to get as far as aiohttp and end `serve` in a long traceback."""
    value = text.strip()
    scheme, sep, rest = value.partition("://")
    if not sep:
        raise ValueError(f"{text!r}: no scheme ({_ENGINE_FORM})")
    kind, scheme = _engine_kind(scheme, text)
    parts = urlsplit(f"{scheme}://{rest}")
    if "@" in parts.netloc:
        raise ValueError(f"{text!r}: credentials in the URL are not supported")
    if not parts.hostname:
        raise ValueError(f"{text!r}: no host ({_ENGINE_FORM})")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or parts.netloc.endswith(":"):
        raise ValueError(f"{text!r}: the port is not a number from 1 to 65535")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"{text!r}: path {parts.path!r}: give the engine's base URL (the service adds the API paths)"
        )
    if parts.query or parts.fragment or "?" in rest or "#" in rest:
        raise ValueError(f"{text!r}: a query or fragment has no place in an engine's base URL")
    return EngineURL(f"{parts.scheme}://{parts.netloc}", kind)


def _engine_kind(scheme: str, text: str) -> tuple[EngineKind, str]:
    """The kind named by a `KIND+` prefix of `scheme` (vLLM without one) and the bare scheme."""
    kind_text, plus, bare = scheme.rpartition("+")
    kind = EngineKind.VLLM
    if plus:
        try:
            kind = EngineKind(kind_text.lower())
        except ValueError:
            known = ", ".join(sorted(k.value for k in EngineKind))
            raise ValueError(f"{text!r}: unknown engine kind {kind_text!r} (known: {known})") from None
    if bare.lower() not in ("http", "https"):
        raise ValueError(f"{text!r}: scheme {bare!r} is not http or https ({_ENGINE_FORM})")
    return kind, bare.lower()


def _engine_argument(text: str) -> str:
    """`parse_engine_url` as an argparse type (argparse shows only ArgumentTypeError messages)."""
    try:
        parse_engine_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def read_engines_file(path: str) -> list[EngineURL]:
    """One engine URL per line; blank lines and # comments are ignored. A bad line is a
    SettingsError naming the file and the line number (the file is edited by hand, or by a
    ConfigMap, and re-read on SIGHUP)."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"engines file {path}: {exc}") from exc
    engines: list[EngineURL] = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            engines.append(parse_engine_url(text))
        except ValueError as exc:
            raise SettingsError(f"engines file {path} line {number}: {exc}") from None
    return engines


def engine_list(args: argparse.Namespace) -> list[EngineURL]:
    """The engines of parsed `serve` settings: `--engine` values, then the engines file's lines."""
    engines = [parse_engine_url(text) for text in args.engine]
    if args.engines_file:
        engines += read_engines_file(args.engines_file)
    return engines


def engine_kinds(engines: list[EngineURL]) -> dict[str, str]:
    """URL -> kind of the engines that are not vLLM (`ServerConfig.engine_kinds`)."""
    return {e.url: e.kind.value for e in engines if e.kind is not EngineKind.VLLM}
