"""Which store a process uses, from its flags (the wiring calls this; the step never does)."""

from __future__ import annotations

from rollout_grpc.server.state.api import BufferCaps, BufferStore
from rollout_grpc.server.state.bus import FleetBus
from rollout_grpc.server.state.memory import MemoryStore
from rollout_grpc.server.state.trajectories import MemoryTrajectories, TrajectoryCaps, TrajectoryStore


def store_for(
    url: str, caps: BufferCaps, *, password_file: str | None = None, ca_file: str | None = None
) -> BufferStore:
    """`--state-store`: "" for this process's memory, redis:// or rediss:// for a shared Redis
    (ValueError naming the flag for anything else)."""
    if not url:
        if password_file or ca_file:
            raise ValueError(
                "--state-store-password-file and --state-store-ca-file need --state-store redis(s)://"
            )
        return MemoryStore(caps)
    from rollout_grpc.server.state.redis_store import RedisStore

    return RedisStore(url, caps, password_file=password_file or "", ca_file=ca_file or "")


def trajectories_for(store: BufferStore, caps: TrajectoryCaps) -> TrajectoryStore:
    """The agent sessions' store in the same place as the step buffers (`--state-store`): this
    process's memory, or the Redis of `store` over its connection pool."""
    from rollout_grpc.server.state.redis_store import RedisStore

    if isinstance(store, RedisStore):
        from rollout_grpc.server.state.redis_trajectories import RedisTrajectories

        return RedisTrajectories.sharing(store, caps)
    return MemoryTrajectories(caps)


def bus_for(store: BufferStore) -> FleetBus | None:
    """The fleet bus of `store` when the fleet shares it (Redis: `state/redis_bus.py`); None for
    the embedded stores, whose processes are one replica's workers (their sibling channels carry
    fleet control)."""
    from rollout_grpc.server.state.redis_store import RedisStore

    if isinstance(store, RedisStore):
        from rollout_grpc.server.state.redis_bus import RedisBus

        return RedisBus(store.client, store.name)
    return None
