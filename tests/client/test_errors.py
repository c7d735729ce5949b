"""The exceptions both clients raise: one class per status, rich details decoded, grpc-compatible."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import grpc
import pytest

from rollout_grpc.client import (
    AsyncRolloutClient,
    DeadlineExceededError,
    FieldViolation,
    InvalidArgumentError,
    ResourceExhaustedError,
    RolloutClient,
    RolloutError,
    UnavailableError,
)
from rollout_grpc.client.errors import rollout_error
from tests.client.common import LONG, PROMPT, PUSHBACK_MS, SHORT, RefuseOnce

TOP_P = FieldViolation("sampling_params.top_p", "must be in (0, 1], got 2.0")

#: The deadline of calls to the `silent` service, which never answers. A live replica meets any
#: deadline it can with an ABORTED sample (`--deadline-margin`): 1 ms, and even 0 s in the
#: blocking client, sometimes got that sample instead of DEADLINE_EXCEEDED.
DEADLINE_S = 0.2


def _check_invalid_top_p(err: InvalidArgumentError) -> None:
    assert err.field_violations == [TOP_P]
    # What code written against grpc's errors reads keeps working.
    assert isinstance(err, grpc.RpcError) and isinstance(err, grpc.aio.AioRpcError)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"{TOP_P.field}: {TOP_P.description}"
    assert str(err) == f"INVALID_ARGUMENT: {TOP_P.field}: {TOP_P.description}"
    assert any(key == "grpc-status-details-bin" for key, _ in err.trailing_metadata() or ())


def test_sync_client_raises_typed_errors_on_every_call_kind(target: str, silent: str) -> None:
    with RolloutClient(target, timeout=30) as client:
        with pytest.raises(InvalidArgumentError) as err:
            client.generate(PROMPT, {"top_p": 2.0})
        _check_invalid_top_p(err.value)
        with pytest.raises(InvalidArgumentError) as err:
            list(client.generate_stream(PROMPT, {"top_p": 2.0}))
        _check_invalid_top_p(err.value)
        with pytest.raises(InvalidArgumentError) as err:
            client.generate([PROMPT, PROMPT], {"top_p": 2.0})  # from the batch's threads too
        _check_invalid_top_p(err.value)
        with pytest.raises(InvalidArgumentError) as err:
            client.abort()  # no target: a unary call
        assert [v.field for v in err.value.field_violations] == ["target"]
    with RolloutClient(silent, retry=None) as client, pytest.raises(DeadlineExceededError):
        client.generate(PROMPT, LONG, timeout=DEADLINE_S)


async def test_async_client_raises_typed_errors_on_every_call_kind(target: str, silent: str) -> None:
    async with AsyncRolloutClient(target, timeout=30) as client:
        with pytest.raises(InvalidArgumentError) as err:
            await client.generate(PROMPT, {"top_p": 2.0})
        _check_invalid_top_p(err.value)
        with pytest.raises(InvalidArgumentError) as err:
            _ = [m async for m in client.generate_stream(PROMPT, {"top_p": 2.0})]
        _check_invalid_top_p(err.value)
        with pytest.raises(InvalidArgumentError) as err:
            await client.generate([PROMPT, PROMPT], {"top_p": 2.0})
        _check_invalid_top_p(err.value)
        with pytest.raises(InvalidArgumentError) as err:
            await client.abort()
        assert [v.field for v in err.value.field_violations] == ["target"]
        assert (await client.generate(PROMPT, SHORT)).response_length == 8
    async with AsyncRolloutClient(silent, retry=None) as client:
        with pytest.raises(DeadlineExceededError):
            await client.generate(PROMPT, LONG, timeout=DEADLINE_S)


def test_a_connection_that_fails_is_unavailable() -> None:
    with RolloutClient("127.0.0.1:1", retry=None) as client, pytest.raises(UnavailableError) as err:
        client.server_info(timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_refusals_carry_the_retry_hint_and_unknown_codes_stay_rollout_errors(
    refusing: tuple[str, RefuseOnce],
) -> None:
    address, fake = refusing
    async with AsyncRolloutClient(address, retry=None) as client:
        with pytest.raises(ResourceExhaustedError) as err:
            await client.server_info(timeout=10)
        assert err.value.retry_after == PUSHBACK_MS / 1000  # the fake sends the trailer only
        with pytest.raises(RolloutError) as unknown:
            await client.pause(timeout=10)  # the fake has no Pause: UNIMPLEMENTED has no class
        assert type(unknown.value) is RolloutError
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    fake.arrivals.clear()
    with RolloutClient(address, retry=None) as sync_client, pytest.raises(ResourceExhaustedError) as sync_err:
        await asyncio.to_thread(sync_client.server_info, timeout=10)  # the fake serves in this loop
    assert sync_err.value.retry_after == PUSHBACK_MS / 1000


def test_an_error_pickles_with_its_details(target: str) -> None:
    """Trainers run the client in Ray workers, which pickle the exceptions they raise."""
    with RolloutClient(target) as client, pytest.raises(InvalidArgumentError) as err:
        client.generate(PROMPT, {"top_p": 2.0})
    copy = pickle.loads(pickle.dumps(err.value))
    assert type(copy) is InvalidArgumentError
    _check_invalid_top_p(copy)


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgumentError"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "ResourceExhaustedError"),
        (grpc.StatusCode.UNAVAILABLE, "UnavailableError"),
        (grpc.StatusCode.FAILED_PRECONDITION, "FailedPreconditionError"),
        (grpc.StatusCode.PERMISSION_DENIED, "PermissionDeniedError"),
        (grpc.StatusCode.UNAUTHENTICATED, "UnauthenticatedError"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "DeadlineExceededError"),
        (grpc.StatusCode.NOT_FOUND, "NotFoundError"),
        (grpc.StatusCode.CANCELLED, "CancelledError"),
        (grpc.StatusCode.ABORTED, "AbortedError"),
        (grpc.StatusCode.INTERNAL, "InternalError"),
        (grpc.StatusCode.UNKNOWN, "RolloutError"),
        (grpc.StatusCode.DATA_LOSS, "RolloutError"),
    ],
)
def test_each_status_has_its_class(code: grpc.StatusCode, name: str) -> None:
    error = rollout_error(grpc.aio.AioRpcError(code, None, None, "why"))
    assert type(error).__name__ == name and isinstance(error, RolloutError)
    assert error.code() == code and error.details() == "why" and error.message == "why"


def test_a_bare_rpc_error_becomes_unknown() -> None:
    """grpc.RpcError itself has no `code()`: the conversion must not fail on one."""
    error: Any = rollout_error(grpc.RpcError())
    assert type(error) is RolloutError and error.code() == grpc.StatusCode.UNKNOWN


def test_a_malformed_details_trailer_leaves_the_code_and_message() -> None:
    trailers = grpc.aio.Metadata(("grpc-status-details-bin", b"\xff\xff\xff"))
    error = rollout_error(grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, None, trailers, "bad"))
    assert isinstance(error, InvalidArgumentError) and error.field_violations == []
    assert str(error) == "INVALID_ARGUMENT: bad"
