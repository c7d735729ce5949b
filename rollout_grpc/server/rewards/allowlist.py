"""Which reward URLs a replica lets a RolloutStep call (`serve --reward-url PREFIX`).

A REMOTE reward makes the replica POST samples to a URL the caller names, so the operator pins it
to the reward servers they run. The check compares parsed URLs, never strings: as a string
prefix, `http://rm:8000` also admits `http://rm:8000.attacker.example/` and
`http://rm:8000@attacker.example/` (user info; the request goes to attacker.example), and
`http://rm:8000/score` admits `http://rm:8000/scoreboard` and `http://rm:8000/score/../admin`.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import SplitResult, unquote, urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(parts: SplitResult) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in; ValueError on a bad port."""
    scheme = parts.scheme.lower()
    port = parts.port  # before the default: an explicit `:0` is port 0, not 80
    return scheme, parts.hostname or "", port if port is not None else _DEFAULT_PORTS.get(scheme)


def prefix_problem(prefix: str) -> str | None:
    """Why `prefix` cannot be an allowed reward URL prefix, or None (checked at start)."""
    try:
        parts = urlsplit(prefix)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        return f"{prefix!r}: {exc}"
    if parts.scheme.lower() not in _DEFAULT_PORTS or not parts.hostname:
        return f"{prefix!r}: must be an http(s) URL with a host"
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        return f"{prefix!r}: must be scheme://host[:port][/path] (no user info, query or fragment)"
    return None


def allowed(url: str, prefixes: Sequence[str]) -> bool:
    """Whether `url` is at or under one of `prefixes`: the same scheme, host and port, and a path
    equal to the prefix's or below it at a `/` boundary; no user info, no backslash, no dot
    segments (in any percent-encoding). An empty `prefixes` allows every URL."""
    if not prefixes:
        return True
    if "\\" in url or any(ord(c) <= 0x20 for c in url):
        return False
    try:
        parts = urlsplit(url)
        origin = _origin(parts)
    except ValueError:
        return False
    if parts.username is not None or parts.password is not None:
        return False
    if {".", ".."} & set(unquote(parts.path).split("/")):
        return False
    for prefix in prefixes:
        base = urlsplit(prefix)
        try:
            if _origin(base) != origin:
                continue
        except ValueError:  # a ServerConfig made in code, unchecked by `prefix_problem`
            continue
        root = base.path.rstrip("/")
        if not root or parts.path == root or parts.path.startswith(root + "/"):
            return True
    return False
