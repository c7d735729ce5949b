"""`--reward-url` prefixes compare parsed URLs: scheme, host, port, then the path at a `/`."""

from __future__ import annotations

import pytest

from rollout_grpc.server.rewards.allowlist import allowed, prefix_problem

PINNED = ["http://rm:8000", "https://scores.example/api/v1/"]


@pytest.mark.parametrize(
    "url",
    [
        "http://rm:8000/score",
        "http://rm:8000",
        "http://RM:8000/score",
        "https://scores.example/api/v1",
        "https://scores.example/api/v1/score",
        "https://scores.example:443/api/v1/score",
    ],
)
def test_urls_at_or_under_a_prefix_are_allowed(url: str) -> None:
    assert allowed(url, PINNED)


@pytest.mark.parametrize(
    "url",
    [
        "http://rm:8000.attacker.example/score",  # a longer host
        "http://rm:8000@attacker.example/score",  # user info: the request goes to attacker.example
        "http://rm:80001/score",  # a longer port (not a port either)
        "http://rm:800/score",
        "http://rm/score",  # port 80
        "http://rm:0/score",
        "https://rm:8000/score",  # another scheme
        "https://scores.example/api/v10",  # not at a `/` boundary
        "https://scores.example/api/v1/../../admin",
        "https://scores.example/api/v1/%2e%2e/admin",
        "http://scores.example/api/v1/score",
        "http://rm:8000\\@attacker.example/",
        "http://rm:8000/score x",
    ],
)
def test_urls_that_only_start_with_a_prefixs_text_are_refused(url: str) -> None:
    assert not allowed(url, PINNED)


def test_no_prefix_allows_every_url() -> None:
    assert allowed("http://anywhere.example/rm", [])


@pytest.mark.parametrize(
    ("prefix", "problem"),
    [
        ("ftp://rm", "must be an http(s) URL with a host"),
        ("rm:8000", "must be an http(s) URL with a host"),
        ("http://user:secret@rm/", "no user info, query or fragment"),
        ("http://rm/?key=1", "no user info, query or fragment"),
        ("http://rm:port/", "Port could not be cast"),
    ],
)
def test_a_prefix_that_is_no_origin_is_named(prefix: str, problem: str) -> None:
    assert problem in (prefix_problem(prefix) or "")
    assert prefix_problem("https://rm.example:8443/score") is None
