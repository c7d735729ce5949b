"""Errors the clients raise on their own (beyond grpc's `RpcError`)."""

from __future__ import annotations

from typing import TypeVar

from rollout_grpc._proto import rollout_pb2 as pb

#: The control replies that list per-engine failures.
ControlResponse = TypeVar("ControlResponse", pb.AbortResponse, pb.PauseResponse, pb.ResumeResponse)


class EngineErrors(Exception):
    """Some engines did not do what a control call asked (the replica answered OK for the others).

    `response` is the full reply (which engines did it, and the others' reasons in
    `engine_errors`). Pass `raise_on_engine_errors=False` to the call to get the reply instead.
    When NO engine did it, the call fails with an `RpcError` (FAILED_PRECONDITION or UNAVAILABLE).
    """

    def __init__(self, call: str, response: pb.AbortResponse | pb.PauseResponse | pb.ResumeResponse) -> None:
        self.response = response
        self.engine_errors: list[pb.EngineError] = list(response.engine_errors)
        reasons = "; ".join(f"{e.engine}: {e.error}" for e in self.engine_errors)
        super().__init__(f"{call}: {len(self.engine_errors)} engine(s) failed: {reasons}")


def check_engine_errors(
    call: str, response: ControlResponse, raise_on_engine_errors: bool
) -> ControlResponse:
    """Return `response`, or raise EngineErrors when it lists engine errors and raising is on."""
    if raise_on_engine_errors and response.engine_errors:
        raise EngineErrors(call, response)
    return response
