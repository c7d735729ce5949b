"""One in-flight limit for the whole replica: the workers' admission slots live in shared memory.

`serve --workers N` keeps one admission per worker (its FIFO queue, its per-caller limit), but the
replica-wide in-flight limit (`server_concurrency x engines`) is counted once, in a 16-byte file of
the supervisor's run directory mapped by every worker (`running`, `limit`), changed under an
exclusive `flock` (a few microseconds, never held across an await). A worker that gives a slot back
wakes its siblings through their unix datagram sockets (`wake-<i>`), so a generation queued on one
worker starts when a generation ends on another; no worker polls. A worker first serves its own
queue with a slot it gives back, then wakes the others: the queue is FIFO per worker, not across
workers. The queue limit and the per-caller limit stay per worker (their shares).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

from rollout_grpc.server.facade.calls import TimedAdmission

#: `running`, `limit` as two signed 64-bit integers.
LAYOUT = struct.Struct("qq")
SLOTS_FILE = "admission"


def create_slots(run_dir: str, limit: int) -> None:
    """The shared counter file (the supervisor writes it before any worker starts)."""
    path = Path(run_dir) / SLOTS_FILE
    path.write_bytes(LAYOUT.pack(0, max(1, limit)))
    path.chmod(0o600)


def wake_path(run_dir: str, index: int) -> str:
    """Worker `index`'s wake-up socket."""
    return str(Path(run_dir) / f"wake-{index}")


class SharedSlots:
    """The replica's in-flight counter, shared by its workers."""

    def __init__(self, run_dir: str, index: int, workers: int) -> None:
        self._fd = os.open(Path(run_dir) / SLOTS_FILE, os.O_RDWR)
        self._map = mmap.mmap(self._fd, LAYOUT.size)
        self._others = [wake_path(run_dir, i) for i in range(workers) if i != index]
        self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.setblocking(False)
        self.wake_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.wake_socket.setblocking(False)
        self.wake_socket.bind(wake_path(run_dir, index))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def try_take(self) -> bool:
        """Take a slot if the replica's limit allows."""
        with self._locked():
            running, limit = LAYOUT.unpack_from(self._map)
            if running >= limit:
                return False
            LAYOUT.pack_into(self._map, 0, running + 1, limit)
            return True

    def give_back(self) -> None:
        """Return a slot (the siblings are woken by `notify`)."""
        with self._locked():
            running, limit = LAYOUT.unpack_from(self._map)
            LAYOUT.pack_into(self._map, 0, max(0, running - 1), limit)

    def set_limit(self, limit: int) -> None:
        """The replica's limit after an engines reload (every worker sets the same value)."""
        with self._locked():
            running, _ = LAYOUT.unpack_from(self._map)
            LAYOUT.pack_into(self._map, 0, running, max(1, limit))

    def counts(self) -> tuple[int, int]:
        """(running, limit) of the whole replica."""
        with self._locked():
            running, limit = LAYOUT.unpack_from(self._map)
        return int(running), int(limit)

    def notify(self) -> None:
        """Wake every sibling: a slot may be free (a full socket buffer is a wake-up pending)."""
        for path in self._others:
            with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                self._sender.sendto(b"w", path)

    def close(self) -> None:
        """Release the mapping and the sockets."""
        self.wake_socket.close()
        self._sender.close()
        self._map.close()
        os.close(self._fd)


class SharedAdmission(TimedAdmission):
    """A worker's admission whose in-flight limit is the replica's, counted in `SharedSlots`."""

    def __init__(self, slots: SharedSlots, limit: int, max_queue: int, retry_after_s: float = 1.0) -> None:
        super().__init__(limit, max_queue, retry_after_s)
        self._slots = slots

    def _take(self) -> bool:
        if not self._slots.try_take():
            return False
        self._running += 1
        return True

    def _give_back(self) -> None:
        self._running -= 1
        self._slots.give_back()

    def _release(self) -> None:
        super()._release()  # this worker's queue first
        self._slots.notify()

    def resize(self, limit: int) -> None:
        self._slots.set_limit(limit)
        super().resize(limit)
        self._slots.notify()

    def woken(self) -> None:
        """A sibling gave a slot back: drain the wake-ups, start queued generations that fit."""
        with contextlib.suppress(BlockingIOError):
            while self._slots.wake_socket.recv(64):
                pass
        self._wake()

    def listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake queued generations when a sibling frees a slot (no polling)."""
        loop.add_reader(self._slots.wake_socket.fileno(), self.woken)
