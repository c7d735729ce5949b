"""Engine URLs in gRPC responses, replaced by their labels for callers who are not admins."""

from __future__ import annotations

from collections.abc import Iterable

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.domain.errors import InvalidArgument, RolloutError
from rollout_grpc.server.security.redact import engine_label, redact_text


def redact_sample(sample: pb.Sample) -> None:
    """Replace the engine URLs of a sample's engine attempts (and their error texts) in place."""
    urls = [attempt.engine for attempt in sample.engine_attempts]
    for attempt in sample.engine_attempts:
        attempt.error = redact_text(attempt.error, urls)
        attempt.engine = engine_label(attempt.engine)
    sample.failure_reason = redact_text(sample.failure_reason, urls)


def redact_engine_errors(errors: list[pb.EngineError]) -> None:
    """Replace the engine URLs of engine errors in place."""
    urls = [e.engine for e in errors]
    for error in errors:
        error.error = redact_text(error.error, urls)
        error.engine = engine_label(error.engine)


def redact_error(exc: RolloutError, urls: Iterable[str]) -> None:
    """Replace engine URLs in an error's message (and field description) in place."""
    urls = list(urls)
    exc.message = redact_text(exc.message, urls)
    exc.args = (exc.message,)
    if isinstance(exc, InvalidArgument):
        exc.description = redact_text(exc.description, urls)
