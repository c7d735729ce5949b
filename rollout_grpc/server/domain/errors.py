"""Domain errors. The transport maps each class to one gRPC status code in one place (`status.py`).

The domain raises these without knowing gRPC; `field` names the request field at fault in the
client's terms (e.g. `sample.tokens[3]`, `sampling_params.top_p`), which becomes a
`google.rpc.BadRequest` field violation.
"""

from __future__ import annotations


class RolloutError(Exception):
    """Base class: an error whose message is safe to show to the caller."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(RolloutError):
    """The request is malformed or asks for something the engines cannot honour."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class FailedPrecondition(RolloutError):
    """The request is valid but the system is not in a state to serve it (e.g. R3 not enabled)."""


class NotFound(RolloutError):
    """A named resource (e.g. a model) does not exist."""


class Unavailable(RolloutError):
    """No engine could serve the request; retrying later may succeed."""


class PermissionDenied(RolloutError):
    """The caller is authenticated but its role does not allow this (e.g. a trainer's Abort(all))."""


class ResourceExhausted(RolloutError):
    """A queue, share or rate limit is full; `retry_after_s` is a hint for the client's backoff."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
