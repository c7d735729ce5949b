"""Stream batching: how the tokens of one generation are grouped into stream messages.

The batcher decides when a `TokenBatch` goes out (N tokens, or the oldest T seconds old); the
engine is asked for as many tokens per SSE event as one message holds (`tokens_per_message`), so
that one event becomes one message. Every event and every message costs the service CPU
(bench/profile_notes.md), so both are kept as few as the caller's batching allows. This module
knows nothing of engines, failover or cancellation.
"""

from __future__ import annotations

import time

from rollout_grpc.server.domain.model import GenerateOptions, TokenBatch


class StreamBatcher:
    """Groups new tokens into stream messages: flush at N tokens or when the oldest is T old.

    With a time flush (T > 0) the first tokens of a generation go out at once, so the time to the
    first token is the engine's, not the batching delay (measured: TTFT p50 93-99 ms -> 15-23 ms at
    20 ms/token, bench/profile_notes.md). The age is checked as tokens arrive (no timer task).
    When the engine batches tokens into events (`stream_interval` > 1, `engine_batches`), the
    oldest token of an event was made just after the previous event arrived, so a batch's age
    counts from then; an event that spans the time flush is sent as it arrives.
    """

    __slots__ = (
        "_batched",
        "_first",
        "_interval",
        "_last",
        "_limit",
        "_logprobs",
        "_offset",
        "_since",
        "_text",
        "_tokens",
        "enabled",
    )

    def __init__(self, options: GenerateOptions) -> None:
        self.enabled = not options.final_only
        self._limit = max(1, options.stream_batch_tokens)
        self._interval = options.stream_batch_interval_s
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._text = ""
        self._offset = 0
        self._since = 0.0
        self._first = self._interval > 0
        #: The engine call batches tokens into events; when its last event (or the call) came.
        self._batched = False
        self._last = 0.0

    def engine_batches(self, stream_interval: int) -> None:
        """An engine call starts that sends `stream_interval` tokens per event."""
        self._batched = stream_interval > 1
        self._last = time.monotonic()

    def _open(self, offset: int, now: float) -> None:
        """Start a batch at response position `offset` unless one is pending."""
        if not self._tokens and not self._text:
            self._offset = offset
            self._since = self._last if self._batched else now

    def add(self, offset: int, tokens: list[int], logprobs: list[float], text: str) -> TokenBatch | None:
        if not self.enabled:
            return None
        now = time.monotonic()
        pending = bool(self._tokens or self._text)
        self._open(offset, now)
        self._last = now
        if (
            self._first
            or len(tokens) + len(self._tokens) >= self._limit
            or (self._interval > 0 and now - self._since >= self._interval)
        ):
            self._first = False
            if not pending:
                # The usual case once the engine sends a message's tokens per event: the event is
                # the message, sent without copying it into the batch first.
                return TokenBatch(tokens, logprobs, offset, text)
            self._tokens.extend(tokens)
            self._logprobs.extend(logprobs)
            self._text += text
            return self.flush()
        self._tokens.extend(tokens)
        self._logprobs.extend(logprobs)
        self._text += text
        return None

    def add_text(self, offset: int, text: str) -> None:
        """Text that arrived without tokens (e.g. held back by a stop string until the end)."""
        if self.enabled:
            now = time.monotonic()
            self._open(offset, now)
            self._last = now
            self._text += text

    def flush(self) -> TokenBatch | None:
        if not self.enabled or (not self._tokens and not self._text):
            return None
        batch = TokenBatch(self._tokens, self._logprobs, self._offset, self._text)
        self._tokens, self._logprobs, self._text = [], [], ""
        return batch


def tokens_per_message(limit: int, interval_s: float, gap_s: float | None) -> int:
    """The tokens an engine making one every `gap_s` seconds should send per SSE event
    (`stream_interval`): one event is then one stream message.

    The tokens made in two time flushes, at most `limit`. Such an event spans the time flush when
    it arrives (the batcher counts a batched event's age from the event before it, when its oldest
    token was made: `StreamBatcher.engine_batches`), so it is sent at once: messages at most ~2x
    `interval_s` apart, from one SSE event each (each event and each message cost the service
    25-200 us, bench/profile_notes.md). Twice, not once: an event of the tokens made within one
    flush arrives just before the flush is due and waits for the next, so the message carries two
    events at the same ~2x cadence. The limit caps it: an engine is never asked for more than a
    message holds. The old rule (the tokens of one flush, repeated until the limit) asked an engine
    at 3.3-33 ms/token for up to 120 tokens per event with a 64-token limit, its oldest token up to
    3x the flush old (bench/profile_notes.md, "Fourth pass"). 1 until the engine's speed is
    measured. An engine faster than measured sends events sooner, and the batcher holds them as it
    would single tokens: never more messages than without engine batching.
    """
    limit = max(1, limit)
    if interval_s <= 0:
        return limit
    if gap_s is None:
        return 1
    return max(1, min(limit, int(2 * interval_s / max(gap_s, 1e-6))))
