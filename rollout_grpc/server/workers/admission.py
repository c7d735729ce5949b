"""One in-flight limit for the whole replica: the workers' admission slots live in shared memory.

`serve --workers N` keeps one admission per worker (its FIFO queue, its per-caller limit), but the
replica-wide in-flight limit (`server_concurrency x engines`) is counted once, in a 16-byte file of
the supervisor's run directory mapped by every worker (`running`, `limit`), changed under an
exclusive `flock` (a few microseconds, never held across an await). A worker that gives a slot back
wakes its siblings through their unix datagram sockets (`wake-<i>`), so a generation queued on one
worker starts when a generation ends on another; no worker polls. A worker first serves its own
queue with a slot it gives back, then wakes the others: the queue is FIFO per worker, not across
workers. The queue limit and the per-caller limit stay per worker (their shares).

Only a sibling that waits is woken: after the counter, the file holds one `waiting` flag per
worker, which a worker sets in the same locked section in which it found no free slot (so a slot
given back after that section sees the flag, and one given back before it was free for the take)
and clears, itself, once its queue is empty. Without the flags every generation that ended sent a
datagram to every sibling and woke its event loop for nothing whenever nobody was queued, the usual
case below the limit.

After the flags, one `held` count per worker: the slots that worker holds, changed in the same
locked sections as `running`. A worker killed with slots taken (SIGKILL, OOM) cannot give them
back; the supervisor, before it starts the replacement, takes them off `running`
(`reclaim_slots`) and wakes the waiting siblings, so the replica's limit is not lowered for good
by a crash.
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

#: `running`, `limit` as two signed 64-bit integers; then one 64-bit `waiting` flag per worker,
#: then one 64-bit `held` count per worker.
LAYOUT = struct.Struct("qq")
FLAG = struct.Struct("q")
SLOTS_FILE = "admission"


def create_slots(run_dir: str, limit: int, workers: int) -> None:
    """The shared counter file (the supervisor writes it before any worker starts)."""
    path = Path(run_dir) / SLOTS_FILE
    path.write_bytes(LAYOUT.pack(0, max(1, limit)) + FLAG.pack(0) * (2 * workers))
    path.chmod(0o600)


def _flag_offset(index: int) -> int:
    return LAYOUT.size + FLAG.size * index


def _held_offset(index: int, workers: int) -> int:
    return _flag_offset(workers) + FLAG.size * index


def _file_size(workers: int) -> int:
    return _held_offset(workers, workers)


def _add_held(mapping: mmap.mmap, index: int, workers: int, delta: int) -> None:
    offset = _held_offset(index, workers)
    (held,) = FLAG.unpack_from(mapping, offset)
    FLAG.pack_into(mapping, offset, max(0, held + delta))


def reclaim_slots(run_dir: str, index: int, workers: int) -> int:
    """Give back every slot worker `index` held when it died, clear its waiting flag and wake every
    other worker (a slot may be free now); the number of slots given back. The supervisor calls
    this once the worker has exited and before its replacement starts."""
    fd = os.open(Path(run_dir) / SLOTS_FILE, os.O_RDWR)
    try:
        with mmap.mmap(fd, _file_size(workers)) as mapping:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                running, limit = LAYOUT.unpack_from(mapping)
                (held,) = FLAG.unpack_from(mapping, _held_offset(index, workers))
                LAYOUT.pack_into(mapping, 0, max(0, running - held), limit)
                FLAG.pack_into(mapping, _held_offset(index, workers), 0)
                FLAG.pack_into(mapping, _flag_offset(index), 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for other in range(workers):
            if other != index:
                with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                    sender.sendto(b"w", wake_path(run_dir, other))
    return int(held)


def wake_path(run_dir: str, index: int) -> str:
    """Worker `index`'s wake-up socket."""
    return str(Path(run_dir) / f"wake-{index}")


class SharedSlots:
    """The replica's in-flight counter, shared by its workers."""

    def __init__(self, run_dir: str, index: int, workers: int) -> None:
        self._fd = os.open(Path(run_dir) / SLOTS_FILE, os.O_RDWR)
        self._map = mmap.mmap(self._fd, _file_size(workers))
        self._index = index
        self._workers = workers
        self._waiting = False  # this worker's flag, as last written
        self._others = [(i, wake_path(run_dir, i)) for i in range(workers) if i != index]
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
        """Take a slot if the replica's limit allows; if not, mark this worker as waiting (in the
        same locked section, so the sibling that gives the next slot back wakes it)."""
        with self._locked():
            running, limit = LAYOUT.unpack_from(self._map)
            if running >= limit:
                if not self._waiting:
                    FLAG.pack_into(self._map, _flag_offset(self._index), 1)
                    self._waiting = True
                return False
            LAYOUT.pack_into(self._map, 0, running + 1, limit)
            _add_held(self._map, self._index, self._workers, 1)
            return True

    def stop_waiting(self) -> None:
        """This worker's queue is empty: its siblings need not wake it any more."""
        if self._waiting:
            FLAG.pack_into(self._map, _flag_offset(self._index), 0)
            self._waiting = False

    def waiting(self, index: int) -> bool:
        """Whether worker `index` has generations queued for a slot."""
        return bool(FLAG.unpack_from(self._map, _flag_offset(index))[0])

    def give_back(self) -> None:
        """Return a slot (the siblings are woken by `notify`)."""
        with self._locked():
            running, limit = LAYOUT.unpack_from(self._map)
            LAYOUT.pack_into(self._map, 0, max(0, running - 1), limit)
            _add_held(self._map, self._index, self._workers, -1)

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

    def notify(self, everyone: bool = False) -> None:
        """Wake the siblings that wait (`everyone`: all of them): a slot may be free (a full socket
        buffer is a wake-up pending)."""
        for index, path in self._others:
            if everyone or self.waiting(index):
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

    def _wake(self) -> None:
        super()._wake()
        if not self._queue:
            self._slots.stop_waiting()

    def resize(self, limit: int) -> None:
        self._slots.set_limit(limit)
        super().resize(limit)
        self._slots.notify(everyone=True)

    def woken(self) -> None:
        """A sibling gave a slot back: drain the wake-ups, start queued generations that fit."""
        with contextlib.suppress(BlockingIOError):
            while self._slots.wake_socket.recv(64):
                pass
        self._wake()

    def listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake queued generations when a sibling frees a slot (no polling)."""
        loop.add_reader(self._slots.wake_socket.fileno(), self.woken)
