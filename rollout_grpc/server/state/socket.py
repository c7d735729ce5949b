"""The embedded store of `serve --workers N`: the supervisor's `MemoryStore`, reached over a unix
socket in its 0700 run directory by every worker (`SocketStore`).

One short connection per call (a unix socket connects in microseconds; no pool to keep healthy
across a worker's restart). A frame is a 4-byte length and a pickle of plain values only (str,
int, float, bytes, bool, None, lists and tuples): the unpickler refuses every global, so a frame
cannot name a class or a function. The first item of a request is the per-start sibling secret,
compared in constant time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import pickle
import struct
from collections.abc import Sequence
from typing import Any

import structlog

from rollout_grpc.server.state.api import BufferCaps, Holding, StoredGroup, StoreUnavailable
from rollout_grpc.server.state.memory import MemoryStore
from rollout_grpc.server.state.trajectories import MemoryTrajectories, StoredSession, TrajectoryCaps

log = structlog.get_logger(__name__)

_HEADER = struct.Struct(">I")
#: Largest frame either side accepts (a put of groups up to the per-caller byte cap, plus slack).
MAX_FRAME = 1 << 31


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a state frame names {module}.{name}; only plain values pass")


def _dumps(value: object) -> bytes:
    body = pickle.dumps(value, protocol=5)
    return _HEADER.pack(len(body)) + body


async def _read(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"a state frame of {size} bytes is over {MAX_FRAME}")
    return _PlainUnpickler(io.BytesIO(await reader.readexactly(size))).load()


#: The agent sessions' calls (state/trajectories.py), on the supervisor's `MemoryTrajectories`.
_TRAJECTORY_CALLS = frozenset({"append_turn", "remove_session", "usage"})


async def _dispatch(
    store: MemoryStore, method: str, args: list[Any], trajectories: MemoryTrajectories | None = None
) -> Any:
    """Run one call on the supervisor's store; values in plain form."""
    if method == "read_session" and trajectories is not None:
        found = await trajectories.read_session(args[0])
        return None if found is None else (found.owner, found.turns, found.roles)
    if method in _TRAJECTORY_CALLS and trajectories is not None:
        return await getattr(trajectories, method)(*args)
    if method == "put":
        owner, groups = args
        return await store.put(owner, [StoredGroup(i, s, b) for i, s, b in groups])
    if method == "holding":
        held = await store.holding(args[0])
        return (held.count, held.bytes, sorted(held.indexes))
    if method in {
        "take",
        "take_held",
        "total_bytes",
        "note_lost",
        "take_lost",
        "begin_drain",
        "renew_drain",
        "end_drain",
        "hold_groups",
        "wait_drains",
        "take_lease",
        "renew_lease",
        "release_lease",
        "advance_version",
        "version_order",
        "bump_pause_epoch",
        "pause_epoch",
    }:
        return await getattr(store, method)(*args)
    raise ValueError(f"no state call {method!r}")


async def serve_store(
    path: str, secret: str, store: MemoryStore, trajectories: MemoryTrajectories | None = None
) -> asyncio.Server:
    """Serve `store` (and the agent sessions' `trajectories`) on the unix socket `path` to callers
    that present `secret`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            given, method, args = await _read(reader)
            if not hmac.compare_digest(str(given).encode(), secret.encode()):
                reply: tuple[bool, Any] = (False, "wrong secret")
            else:
                reply = (True, await _dispatch(store, method, list(args), trajectories))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        except Exception as exc:
            log.exception("state_call_failed")
            reply = (False, f"{type(exc).__name__}: {exc}")
        writer.write(_dumps(reply))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(handle, path=path)


async def _call(name: str, path: str, secret: str, method: str, *args: Any) -> Any:
    """One call on the supervisor's store (StoreUnavailable naming it when it does not answer)."""
    try:
        reader, writer = await asyncio.open_unix_connection(path)
    except OSError as exc:
        raise StoreUnavailable(name, f"{type(exc).__name__}: {exc}") from exc
    try:
        writer.write(_dumps((secret, method, args)))
        await writer.drain()
        ok, value = await _read(reader)
    except (OSError, asyncio.IncompleteReadError) as exc:
        raise StoreUnavailable(name, f"{type(exc).__name__}: {exc}") from exc
    finally:
        writer.close()
    if not ok:
        raise StoreUnavailable(name, str(value))
    return value


class SocketStore:
    """`BufferStore` in the supervisor's memory, reached over its unix socket."""

    def __init__(self, path: str, secret: str, caps: BufferCaps | None = None) -> None:
        self.name = f"embedded (the supervisor's, {path})"
        self.caps = caps or BufferCaps()
        self._path = path
        self._secret = secret

    async def _call(self, method: str, *args: Any) -> Any:
        return await _call(self.name, self._path, self._secret, method, *args)

    async def put(self, owner: str, groups: Sequence[StoredGroup]) -> list[int]:
        refused: list[int] = await self._call("put", owner, [(g.index, g.size, g.blob) for g in groups])
        return refused

    async def take(self, owner: str) -> list[bytes]:
        blobs: list[bytes] = await self._call("take", owner)
        return blobs

    async def take_held(self, owner: str, lease: str) -> list[bytes]:
        blobs: list[bytes] = await self._call("take_held", owner, lease)
        return blobs

    async def holding(self, owner: str) -> Holding:
        count, size, indexes = await self._call("holding", owner)
        return Holding(count, size, frozenset(indexes))

    async def total_bytes(self) -> int:
        return int(await self._call("total_bytes"))

    async def note_lost(self, owner: str, indexes: Sequence[int]) -> None:
        await self._call("note_lost", owner, list(indexes))

    async def take_lost(self, owner: str) -> list[int]:
        lost: list[int] = await self._call("take_lost", owner)
        return lost

    async def begin_drain(self, owner: str, lease: str) -> None:
        await self._call("begin_drain", owner, lease)

    async def renew_drain(self, owner: str, lease: str) -> bool:
        return bool(await self._call("renew_drain", owner, lease))

    async def end_drain(self, owner: str, lease: str) -> None:
        await self._call("end_drain", owner, lease)

    async def hold_groups(self, owner: str, lease: str, indexes: Sequence[int]) -> None:
        await self._call("hold_groups", owner, lease, list(indexes))

    async def wait_drains(self, owner: str, timeout_s: float) -> bool:
        return bool(await self._call("wait_drains", owner, timeout_s))

    async def ping(self) -> None:
        await self._call("total_bytes")

    async def close(self) -> None:
        return None

    async def take_lease(self, name: str, holder: str, ttl_s: float) -> str:
        return str(await self._call("take_lease", name, holder, ttl_s))

    async def renew_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        return bool(await self._call("renew_lease", name, holder, ttl_s))

    async def release_lease(self, name: str, holder: str) -> None:
        await self._call("release_lease", name, holder)

    async def advance_version(self, label: str) -> tuple[bool, list[str]]:
        ok, order = await self._call("advance_version", label)
        return bool(ok), list(order)

    async def version_order(self) -> list[str]:
        order: list[str] = await self._call("version_order")
        return order

    async def bump_pause_epoch(self) -> int:
        return int(await self._call("bump_pause_epoch"))

    async def pause_epoch(self) -> int:
        return int(await self._call("pause_epoch"))


class SocketTrajectories:
    """`TrajectoryStore` in the supervisor's memory, reached over its unix socket."""

    def __init__(self, path: str, secret: str, caps: TrajectoryCaps | None = None) -> None:
        self.name = f"embedded (the supervisor's, {path})"
        self.trajectory_caps = caps or TrajectoryCaps()
        self._path = path
        self._secret = secret

    async def read_session(self, session_id: str) -> StoredSession | None:
        found = await _call(self.name, self._path, self._secret, "read_session", session_id)
        if found is None:
            return None
        owner, turns, roles = found
        return StoredSession(str(owner), list(turns), bytes(roles))

    async def append_turn(self, owner: str, session_id: str, expected: int, turn: bytes, roles: bytes) -> str:
        args = (owner, session_id, expected, turn, roles)
        return str(await _call(self.name, self._path, self._secret, "append_turn", *args))

    async def remove_session(self, owner: str, session_id: str, turns: int) -> bool:
        return bool(
            await _call(self.name, self._path, self._secret, "remove_session", owner, session_id, turns)
        )

    async def usage(self, owner: str) -> tuple[int, int]:
        count, size = await _call(self.name, self._path, self._secret, "usage", owner)
        return int(count), int(size)

    async def close(self) -> None:
        return None
