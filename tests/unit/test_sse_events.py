"""The shared SSE line splitter of the engine adapters (`engines/http.take_events`)."""

from __future__ import annotations

import tracemalloc

import pytest

from rollout_grpc.server.engines.http import take_events


@pytest.mark.parametrize(
    ("raw", "events", "rest"),
    [
        (b'data: {"a":1}\r\n\r\ndata:  x \n', [b'{"a":1}', b"x"], b""),
        (b": a comment\ndata: [DONE]\n", [b"[DONE]"], b""),
        (b"data: \n", [b""], b""),
        (b"event: x\ndata:{}\n", [], b""),
        (b"data: 1\ndata: 2", [b"1"], b"data: 2"),
    ],
)
def test_complete_data_lines_are_taken_trimmed(raw: bytes, events: list[bytes], rest: bytes) -> None:
    buf = bytearray(raw)
    taken, scan = take_events(buf, 0)
    assert taken == events and bytes(buf) == rest and scan == len(rest)


def test_a_huge_event_is_copied_once() -> None:
    """A 250 MiB event was copied three times (slice, bytes, strip): 4-7 s of the replica's event
    loop on a loaded machine, long enough to stall every stream and health probe. Measured in
    memory, not time: the peak allocation of taking a 32 MiB event is one copy of it."""
    size = 32 << 20
    buf = bytearray(b"data: {" + b" " * size + b"}\r\n\n")
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        [event], _ = take_events(buf, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(event) == size + 2 and event[:1] == b"{" and event[-1:] == b"}"
    assert peak < 1.5 * size, f"{peak / size:.1f} copies of the event"
