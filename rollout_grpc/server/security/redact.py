"""Engine URLs are for admins: other callers see a stable opaque label instead.

Engine base URLs are internal addresses (often of routes that must never be reachable from
trainers, see docs/security.md). A non-admin caller sees `engine-<8 hex>`, a hash of the URL: the
same engine gets the same label on every replica and in every response, so trainers can still
correlate failovers and per-engine health, without learning where the engines live.
"""

from __future__ import annotations

import hashlib

from rollout_grpc._proto import rollout_pb2 as pb


def engine_label(url: str) -> str:
    """The opaque, stable label shown for `url` to callers who may not see engine addresses."""
    if not url:
        return ""
    return "engine-" + hashlib.sha256(url.encode()).hexdigest()[:8]


def redact_text(text: str, urls: list[str]) -> str:
    """`text` with every occurrence of the given engine URLs replaced by their labels."""
    for url in urls:
        if url and url in text:
            text = text.replace(url, engine_label(url))
    return text


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
