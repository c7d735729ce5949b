"""Engine URLs are for admins: other callers see a stable opaque label instead.

Engine base URLs are internal addresses (often of routes that must never be reachable from
trainers, see docs/security.md). A non-admin caller sees `engine-<8 hex>`, a hash of the URL: the
same engine gets the same label on every replica and in every response, so trainers can still
correlate failovers and per-engine health, without learning where the engines live. Each door
applies the label to its own messages (`front/grpc/redaction.py`, the front door's errors).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from urllib.parse import urlsplit


def engine_label(url: str) -> str:
    """The opaque, stable label shown for `url` to callers who may not see engine addresses."""
    if not url:
        return ""
    return "engine-" + hashlib.sha256(url.encode()).hexdigest()[:8]


def redact_text(text: str, urls: Iterable[str]) -> str:
    """`text` with every occurrence of the given engine URLs, and of their bare `host:port`
    (as connection errors name them), replaced by their labels."""
    for url in urls:
        if not url:
            continue
        label = engine_label(url)
        if url in text:
            text = text.replace(url, label)
        netloc = urlsplit(url).netloc
        if netloc and netloc in text:
            text = text.replace(netloc, label)
    return text
