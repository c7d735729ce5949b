"""Fleet test helpers."""

from __future__ import annotations

from rollout_grpc.sim import SimEngine


def session_on(engines: list[SimEngine], target: SimEngine, pool_pick: object) -> str:
    """A session id whose affinity engine is `target` (found by asking the replica's own pool)."""
    for i in range(1000):
        sid = f"session-{i}"
        chosen = pool_pick(sid)  # type: ignore[operator]
        if chosen is not None and chosen.url == target.url:
            return sid
    raise AssertionError("no session maps to the target engine")
