"""The replica's closed vocabularies, each named once: engine kinds and pause modes.

Every other place derives from these (the settings' `KIND+` URL prefix, the engine registry, the
gRPC door's and the sibling service's proto mapping, an adapter's translation), and
`tests/unit/test_vocabularies.py` fails when one of them misses a member. Reward kinds are the
rewards room's (`rewards/api.RewardKind`, mapped from the proto by name), sampling knobs the
domain's knob table (`params.KNOBS`).
"""

from __future__ import annotations

import enum


class EngineKind(enum.StrEnum):
    """The engine software behind a URL, given as an optional `KIND+` prefix of the scheme
    (`sglang+http://...`); one adapter sub-package of `server/engines/` per kind."""

    VLLM = "vllm"
    SGLANG = "sglang"


#: The kind of an engine URL without a `KIND+` prefix.
DEFAULT_ENGINE_KIND = EngineKind.VLLM


class PauseMode(enum.StrEnum):
    """How Pause (and UpdateWeights) stops generation (the proto's `PauseMode`, lower-cased)."""

    #: Abort what is in flight (each generation ends ABORTED with its tokens, or resumes after).
    ABORT = "abort"
    #: Let what is in flight finish, admit nothing new.
    WAIT = "wait"
    #: Freeze what is in flight in place; it continues on Resume.
    KEEP = "keep"
