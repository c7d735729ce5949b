"""Request bounds and per-caller control rate limits, checked before any work is done.

Every cap is a `ServerConfig` field and a CLI flag (table in docs/security.md). A request over a
size cap is refused with INVALID_ARGUMENT naming the field and the limit (e.g. `sample.metadata:
4194304 bytes, over the limit max_metadata_bytes=1048576`); a caller over its control-RPC rate is
refused with RESOURCE_EXHAUSTED and a retry hint. The per-caller in-flight share is enforced where
generations are registered (`inflight.InFlightRegistry`); image byte and pixel limits belong to
`render.py`.

Each door applies them to its own requests (the gRPC door in `front/grpc/interceptor.py`, after
authentication: the rate limit is per caller).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollout_grpc.server.domain.errors import InvalidArgument, ResourceExhausted


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request caps (see docs/security.md for the reasoning behind each default)."""

    #: Request ids in one Abort (each costs engine work on every engine).
    max_abort_ids: int = 1024
    #: Serialized size of `Sample.metadata` (echoed back in the final sample).
    max_metadata_bytes: int = 1 << 20
    #: Entries of `SamplingParams.stop`.
    max_stop_strings: int = 64
    #: Characters of one stop string.
    max_stop_string_chars: int = 1024
    #: Serialized size of `RenderRequest.chat_template_kwargs`.
    max_chat_template_kwargs_bytes: int = 64 << 10
    #: Serialized size of a request of a small RPC (Abort, Pause, Resume, GetServerInfo,
    #: GetTrajectory, AbortLocal), checked on the bytes before they are decoded. 1024 request ids
    #: of 256 characters are ~270 KB; only Generate, RolloutStep and Render carry payloads (prompts,
    #: partial samples, routed experts, images) up to the gRPC message limit.
    max_control_request_bytes: int = 1 << 20
    #: Serialized size of a request to the open health service (no credentials, nothing to carry).
    max_open_request_bytes: int = 4 << 10
    #: Characters of prompt text one chat render may carry (message text, tool-call arguments, tool
    #: definitions; images have their own byte and pixel caps), checked before anything is sent to
    #: an engine: a 60 MiB chat turn kept an engine's renderer busy until its health probe failed
    #: and every caller got 503. 4 Mi characters are ~1M tokens, above any served context.
    max_prompt_chars: int = 4 << 20

    def check_prompt(self, field: str, chars: int) -> None:
        """Raise InvalidArgument naming `field` when a prompt's `chars` exceed `max_prompt_chars`."""
        if chars > self.max_prompt_chars:
            cap = self.max_prompt_chars
            raise InvalidArgument(
                field, f"{chars} characters of prompt text, over the limit max_prompt_chars={cap}"
            )

    def check_request_bytes(self, size: int, limit: str) -> None:
        """Raise InvalidArgument naming the request when `size` serialized bytes exceed the cap
        named `limit` (`max_control_request_bytes` or `max_open_request_bytes`); called before
        the bytes are decoded, so a large request costs its bytes, never its decoded objects."""
        cap = int(getattr(self, limit))
        if size > cap:
            raise InvalidArgument("request", f"{size} bytes, over the limit {limit}={cap}")

    def check_ids(self, count: int) -> None:
        """Raise InvalidArgument when one Abort lists more request ids than `max_abort_ids`."""
        if count > self.max_abort_ids:
            raise InvalidArgument(
                "request_ids.ids",
                f"{count} ids, over the limit max_abort_ids={self.max_abort_ids}; split the abort",
            )

    def check_stop(self, stop: Sequence[str], field: str) -> None:
        """Raise InvalidArgument naming `field` when the stop strings exceed their caps."""
        if len(stop) > self.max_stop_strings:
            raise InvalidArgument(
                field,
                f"{len(stop)} stop strings, over the limit max_stop_strings={self.max_stop_strings}",
            )
        for i, text in enumerate(stop):
            if len(text) > self.max_stop_string_chars:
                raise InvalidArgument(
                    f"{field}[{i}]",
                    f"{len(text)} characters, over the limit "
                    f"max_stop_string_chars={self.max_stop_string_chars}",
                )

    def check_size(self, field: str, size: int, limit: str) -> None:
        """Raise InvalidArgument naming `field` when `size` bytes exceed the cap named `limit`
        (`max_metadata_bytes` or `max_chat_template_kwargs_bytes`); for callers outside gRPC,
        such as the OpenAI front door, which measure their JSON themselves."""
        cap = int(getattr(self, limit))
        if size > cap:
            raise InvalidArgument(field, f"{size} bytes, over the limit {limit}={cap}")


class ControlRateLimiter:
    """A token bucket per caller identity: `burst` calls at once, refilled at `rate_per_s`."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate_per_s
        self._burst = max(1, burst)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}

    @property
    def enabled(self) -> bool:
        """A rate of 0 or less disables the limit."""
        return self._rate > 0

    def acquire(self, identity: str) -> None:
        """Take one call from `identity`'s bucket, or raise ResourceExhausted naming the limit."""
        if not self.enabled:
            return
        now = self._clock()
        tokens, last = self._buckets.get(identity, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - last) * self._rate)
        if tokens < 1.0:
            wait = (1.0 - tokens) / self._rate
            self._buckets[identity] = (tokens, now)
            raise ResourceExhausted(
                f"control RPC rate limit for caller {identity!r} reached (control_rate_per_s="
                f"{self._rate:g}, control_burst={self._burst}); retry in {wait:.2f} s",
                wait,
            )
        self._buckets[identity] = (tokens - 1.0, now)
