"""How control fan-out failures are classified and when the RPC fails (issue 14 item 2)."""

from __future__ import annotations

import pytest

from rollout_grpc.server.domain.errors import FailedPrecondition, Unavailable
from rollout_grpc.server.engines.api import EngineRejected, EngineRequestFailed, EngineUnavailable
from rollout_grpc.server.engines.vllm.adapter import DEV_MODE_HINT
from rollout_grpc.server.rollout.control import ControlFailure, FleetResult, describe_failure

URL = "http://engine:8000"


def test_a_404_names_the_dev_mode_flag_never_the_raw_body() -> None:
    kind, message = describe_failure(
        EngineRejected(URL, '{"detail":"Not Found"}', not_found=True), "/pause", DEV_MODE_HINT
    )
    assert kind is ControlFailure.NOT_FOUND
    assert DEV_MODE_HINT in message and "/pause" in message and "detail" not in message


def test_other_failures_say_what_happened() -> None:
    assert describe_failure(EngineRequestFailed(URL, "HTTP 500: boom"), "/resume") == (
        ControlFailure.REJECTED,
        "/resume failed on the engine: HTTP 500: boom",
    )
    kind, message = describe_failure(EngineUnavailable(URL, "connection refused"), "/resume")
    assert kind is ControlFailure.UNREACHABLE and "connection refused" in message


def _result(ok: list[str], kinds: list[ControlFailure]) -> FleetResult:
    result = FleetResult(ok=list(ok))
    for i, kind in enumerate(kinds):
        result.fail(f"http://e{i}", kind, kind.value)
    return result


@pytest.mark.parametrize(
    ("kinds", "error"),
    [
        ([ControlFailure.NOT_FOUND, ControlFailure.NOT_FOUND], FailedPrecondition),
        ([ControlFailure.NOT_FOUND, ControlFailure.UNREACHABLE], FailedPrecondition),
        ([ControlFailure.UNREACHABLE, ControlFailure.TIMEOUT, ControlFailure.SKIPPED], Unavailable),
        ([ControlFailure.REJECTED], Unavailable),
    ],
)
def test_no_engine_did_it_fails_the_rpc(kinds: list[ControlFailure], error: type[Exception]) -> None:
    with pytest.raises(error) as raised:
        _result([], kinds).raise_if_none_ok("pause")
    assert all(f"http://e{i}" in str(raised.value) for i in range(len(kinds)))


@pytest.mark.parametrize(("ok", "kinds"), [(["http://a"], [ControlFailure.NOT_FOUND]), ([], [])])
def test_partial_failures_and_empty_fan_outs_do_not_fail_the_rpc(
    ok: list[str], kinds: list[ControlFailure]
) -> None:
    _result(ok, kinds).raise_if_none_ok("pause")
