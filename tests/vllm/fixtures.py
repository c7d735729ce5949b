"""Pytest plugin with the live-vLLM fixtures. Register it once, in the root ``tests/conftest.py``::

    pytest_plugins = ["tests.vllm.fixtures"]

(``tools/vllm/run_tier.sh`` also passes ``-p tests.vllm.fixtures``; registering a plugin twice is a
no-op.) Fixtures, each the base URL ``http://127.0.0.1:PORT`` of a real vLLM 0.32 server (running
when the test gets it; the servers live for the session): ``vllm_dense_url`` (tiny-llama),
``vllm_moe_url`` (tiny-qwen3moe), ``vllm_vl_url`` (tiny-qwen2vl); ``vllm_servers`` (session-scoped)
is the :class:`VllmServerManager` itself.

Without ``ROLLOUT_VLLM=1`` (plain ``make test``) every one of them skips, so nothing starts vLLM.

Servers start before the first test that needs them, in ``pytest_runtest_protocol`` outside that
test's pytest-timeout budget (a cold start can take a minute), and stop when the session ends. A
fixture requested dynamically (``request.getfixturevalue``) starts its server with the test's timeout
clock stopped instead; such a test declares the kinds it requests with
``@pytest.mark.vllm_server("vl", ...)`` so that it is pre-started and ordered like the others.

With the tier enabled, the tests are reordered (stably) by the server kinds they use — first the
tests that need no server, then dense, dense+moe, moe, …, vl — so that each server starts once even
when at most ``ROLLOUT_VLLM_MAX_SERVERS`` run at a time (in file order the tier interleaved the kinds
and restarted each server up to 8 times). The end-of-session summary counts the starts per kind.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from tests.vllm.servers import (
    MODEL_KINDS,
    ModelKind,
    VllmServerManager,
    VllmStartError,
    manager,
    skip_reason,
)

FIXTURE_KINDS: dict[str, ModelKind] = {f"vllm_{kind}_url": kind for kind in MODEL_KINDS}

_current_item: pytest.Item | None = None  # the test being run, for pausing its timeout


def _needed_kinds(item: pytest.Item) -> list[ModelKind]:
    """The server kinds ``item`` uses: its static ``vllm_*_url`` fixtures, plus, for a test marked
    ``vllm``, the kinds its ``vllm_server`` markers declare for fixtures requested dynamically."""
    names: list[str] = list(getattr(item, "fixturenames", ()))
    kinds = [FIXTURE_KINDS[name] for name in names if name in FIXTURE_KINDS]
    if item.get_closest_marker("vllm") is not None:
        for marker in item.iter_markers("vllm_server"):
            for kind in marker.args:
                if kind not in MODEL_KINDS:
                    raise pytest.UsageError(
                        f"{item.nodeid}: vllm_server({kind!r}): expected one of {', '.join(MODEL_KINDS)}"
                    )
                kinds.append(kind)
    return list(dict.fromkeys(kinds))


def _server_order(kinds: list[ModelKind]) -> tuple[int, int]:
    """Sort key that runs the tests of one server kind together: tests without a server first, then
    by the last and first kind they need in ``MODEL_KINDS`` order (dense, dense+moe, moe, …, vl).
    Consecutive groups share a kind, so a manager keeping two servers starts each kind once."""
    if not kinds:
        return (-1, -1)
    positions = [MODEL_KINDS.index(kind) for kind in kinds]
    return (max(positions), min(positions))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group the tier's tests by server kind (stable: file order is kept within a group)."""
    if skip_reason() is not None:
        return
    items.sort(key=lambda item: _server_order(_needed_kinds(item)))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    # tryfirst makes this wrapper the outermost one, so pytest-timeout's timer is not running yet.
    global _current_item  # noqa: PLW0603 - tests run one at a time in a session
    kinds = _needed_kinds(item)
    if kinds and skip_reason() is None:
        # A start failure is remembered by the manager; the fixture then reports it as this test's error.
        with contextlib.suppress(VllmStartError):
            manager().ensure(kinds)
    _current_item = item
    try:
        yield
    finally:
        _current_item = None


def _timeout_settings(item: pytest.Item) -> Any:
    """pytest-timeout's settings for ``item`` when a timeout applies, else None."""
    try:
        plugin = importlib.import_module("pytest_timeout")
    except ImportError:
        return None
    get_settings = getattr(plugin, "_get_item_settings", None)
    if get_settings is None or not item.config.pluginmanager.has_plugin("timeout"):
        return None
    settings = get_settings(item)
    return settings if settings.timeout else None


@contextlib.contextmanager
def timeout_paused() -> Iterator[None]:
    """Stop the current test's pytest-timeout clock while a server starts; restart it afterwards.

    Covers fixtures requested dynamically (``request.getfixturevalue``), which the pre-start in
    ``pytest_runtest_protocol`` cannot see, and servers a test starts itself (a fresh vLLM on a
    checkpoint): on a machine with both cores busy a cold start took over 90 s, and pytest-timeout
    killed it with the test inside its 120 s.
    """
    item = _current_item
    settings = _timeout_settings(item) if item is not None else None
    if item is None or settings is None:
        yield
        return
    hook = item.config.pluginmanager.hook
    hook.pytest_timeout_cancel_timer(item=item)
    try:
        yield
    finally:
        hook.pytest_timeout_set_timer(item=item, settings=settings)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if skip_reason() is None:
        manager().stop_all()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if skip_reason() is None and manager().events:
        terminalreporter.section("vllm servers")
        for line in manager().events:
            terminalreporter.write_line(line)
        starts = ", ".join(f"{kind} {count}" for kind, count in manager().starts.items())
        terminalreporter.write_line(f"server starts: {starts}")


def pytest_report_header(config: pytest.Config) -> str:
    reason = skip_reason()
    return "vllm tier: enabled" if reason is None else f"vllm tier: off ({reason})"


def _url(kind: ModelKind) -> str:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    mgr = manager()
    item = _current_item
    if item is not None and kind not in _needed_kinds(item):
        # Not pre-started and not ordered with its kind: it may restart a server. Declare it.
        mgr.events.append(f"{kind}: requested by {item.nodeid} without @pytest.mark.vllm_server({kind!r})")
    if kind in mgr.running_kinds():
        return mgr.url(kind)
    with timeout_paused():
        return mgr.url(kind)


@pytest.fixture(scope="session")
def vllm_servers() -> Generator[VllmServerManager, None, None]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    mgr = manager()
    yield mgr
    mgr.stop_all()


# The URL fixtures are function-scoped on purpose: a session-cached value would hand a later test the
# address of a server evicted meanwhile (at most ROLLOUT_VLLM_MAX_SERVERS run at once). Asking the
# manager for every test restarts an evicted server on its port; when it is running that is free.


@pytest.fixture
def vllm_dense_url(vllm_servers: VllmServerManager) -> str:
    """tiny-llama (LlamaForCausalLM), ``--max-model-len 4096``."""
    return _url("dense")


@pytest.fixture
def vllm_moe_url(vllm_servers: VllmServerManager) -> str:
    """tiny-qwen3moe (Qwen3MoeForCausalLM, 8 experts top-2), ``--max-model-len 4096``."""
    return _url("moe")


@pytest.fixture
def vllm_vl_url(vllm_servers: VllmServerManager) -> str:
    """tiny-qwen2vl (Qwen2VLForConditionalGeneration), ``--max-model-len 1024``, up to 2 images."""
    return _url("vl")
