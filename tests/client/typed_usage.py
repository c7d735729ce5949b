"""What a trainer's type checker sees of the clients: precise types, never `Any`.

Never run, only type-checked: by `make lint` (mypy --strict over tests/) and, as an installed
package a user's mypy finds through its `py.typed` marker, by tests/client/test_typing.py.
`assert_type` fails the check when an expression has another type, `Any` included.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from typing import TYPE_CHECKING

import numpy as np

from rollout_grpc.client import (
    AsyncRolloutClient,
    FieldViolation,
    InvalidArgumentError,
    ResourceExhaustedError,
    RolloutClient,
    RolloutError,
    make_sample,
    pb,
)

if TYPE_CHECKING:
    from typing_extensions import assert_type

PARAMS = {"temperature": 1.0, "max_new_tokens": 16}


def blocking(client: RolloutClient, ids: list[int], grid: np.ndarray) -> None:
    assert_type(client.generate(ids, PARAMS), pb.Sample)
    assert_type(client.generate((1, 2, 3)), pb.Sample)
    assert_type(client.generate(make_sample(ids)), pb.Sample)
    assert_type(client.generate({"tokens": ids}), pb.Sample)
    assert_type(client.generate([np.int64(1), np.int64(2)]), pb.Sample)
    assert_type(client.generate([ids, ids], PARAMS, request_ids=["a", "b"]), list[pb.Sample])
    assert_type(client.generate([make_sample(ids)]), list[pb.Sample])
    assert_type(client.generate([]), list[pb.Sample])
    assert_type(client.generate(grid), pb.Sample | list[pb.Sample])
    assert_type(client.generate_stream(ids), Generator[pb.GenerateResponse, None, None])
    assert_type(client.abort(all=True), pb.AbortResponse)
    assert_type(client.pause("abort"), pb.PauseResponse)
    assert_type(client.resume("v2"), pb.ResumeResponse)
    assert_type(client.get_server_info(), pb.GetServerInfoResponse)
    assert_type(client.server_info(), pb.GetServerInfoResponse)  # the alias
    assert_type(client.render(text="hi"), pb.RenderResponse)
    assert_type(client.get_trajectory("s"), pb.GetTrajectoryResponse)


async def asynchronous(client: AsyncRolloutClient, ids: list[int]) -> None:
    assert_type(await client.generate(ids, PARAMS), pb.Sample)
    assert_type(await client.generate([ids, ids]), list[pb.Sample])
    assert_type(client.generate_stream(ids), AsyncGenerator[pb.GenerateResponse, None])
    assert_type(await client.abort(all=True), pb.AbortResponse)
    assert_type(await client.pause("abort"), pb.PauseResponse)
    assert_type(await client.resume("v2"), pb.ResumeResponse)
    assert_type(await client.get_server_info(), pb.GetServerInfoResponse)
    assert_type(await client.server_info(), pb.GetServerInfoResponse)  # the alias
    assert_type(await client.render(text="hi"), pb.RenderResponse)
    assert_type(await client.get_trajectory("s"), pb.GetTrajectoryResponse)


def errors(client: RolloutClient, ids: list[int]) -> float | None:
    try:
        client.generate(ids)
    except InvalidArgumentError as err:
        assert_type(err.field_violations, list[FieldViolation])
        assert_type(err.field_violations[0].field, str)
    except ResourceExhaustedError as err:
        return err.retry_after
    except RolloutError as err:
        assert_type(err.message, str)
        assert_type(err.details(), str | None)
    return None
