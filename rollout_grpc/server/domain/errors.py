"""Domain errors, each with its canonical status code (`code`, the names gRPC uses).

Each door maps `code` onto its wire in one place (`front/grpc/status.py`, and the OpenAI front
door's `protocol.from_domain`); the call record names outcomes by it (`facade/calls.py`).

The domain raises these without knowing gRPC; `field` names the request field at fault in the
client's terms (e.g. `sample.tokens[3]`, `sampling_params.top_p`), which becomes a
`google.rpc.BadRequest` field violation.
"""

from __future__ import annotations


class RolloutError(Exception):
    """Base class: an error whose message is safe to show to the caller."""

    code = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(RolloutError):
    """The request is malformed or asks for something the engines cannot honour."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class FailedPrecondition(RolloutError):
    """The request is valid but the system is not in a state to serve it (e.g. R3 not enabled)."""

    code = "FAILED_PRECONDITION"


class NotFound(RolloutError):
    """A named resource (e.g. a model) does not exist."""

    code = "NOT_FOUND"


class Unavailable(RolloutError):
    """No engine could serve the request; retrying later may succeed."""

    code = "UNAVAILABLE"


class PermissionDenied(RolloutError):
    """The caller is authenticated but its role does not allow this (e.g. a trainer's Abort(all))."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(RolloutError):
    """A queue, share or rate limit is full; `retry_after_s` is a hint for the client's backoff."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
