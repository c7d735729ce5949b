"""The supervisor <-> worker channel: one socket pair per worker, JSON lines, never a CLI argument.

The supervisor starts each worker as a subprocess of the same console script (so the worker parses
exactly the flags, environment and config file the supervisor parsed) and names the inherited end
of the pair in `WORKER_FD_VARIABLE`. It writes one `WorkerSpec` line (port, index, the run
directory, the per-start sibling secret, the engines); the worker answers one line, `ready` (with
its pid and side ports) or `error` (one message, printed by the supervisor). The pair then stays
open and carries the drain (`DrainLink`):

* supervisor -> worker `{"drain": "stop_accepting"}`: refuse new calls, close the listener, answer
  `{"stopped_accepting": true}`; then `{"drain": "finish"}`: health NOT_SERVING, grace, aborts,
  exit. The supervisor sends `finish` only once every worker answered, so the health port never
  says NOT_SERVING while a sibling still accepts (docs/workers.md, "Drain").
* worker -> supervisor `{"stop_requested": "<signal>"}`: a SIGTERM/SIGINT reached the worker itself
  (Ctrl-C reaches the whole process group, systemd the whole cgroup); the supervisor drains the
  replica as for its own signal.

End-of-file tells a worker that its supervisor is gone (it stops on its own, gracefully), and the
supervisor that the worker is exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Environment variable naming the worker's end of its socket pair (its presence makes a worker).
WORKER_FD_VARIABLE = "ROLLOUT_WORKER_FD"
#: The secret's metadata key on sibling calls.
SIBLING_METADATA_KEY = "x-rollout-sibling"
#: Longest handshake line (the engine list dominates).
MAX_LINE_BYTES = 1 << 20
#: The drain's phases (supervisor -> worker) and their messages' keys.
DRAIN = "drain"
STOP_ACCEPTING = "stop_accepting"
FINISH = "finish"
STOPPED_ACCEPTING = "stopped_accepting"
STOP_REQUESTED = "stop_requested"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs from its supervisor."""

    index: int
    workers: int
    #: The gRPC port the supervisor reserved (resolved: never 0).
    port: int
    #: The 0700 directory of the workers' private unix sockets.
    run_dir: str
    #: The per-start sibling secret: a sibling call presents it; never logged, never an argument.
    secret: str
    engines: list[str]
    engine_kinds: dict[str, str] = field(default_factory=dict)
    simulated: bool = False
    #: The OpenAI front door's port the supervisor reserved (None: off); every worker serves it.
    openai_port: int | None = None

    def sibling_socket(self, index: int) -> str:
        """The unix socket path of worker `index`."""
        return str(Path(self.run_dir) / f"worker-{index}.sock")

    @property
    def state_socket(self) -> str:
        """The unix socket of the supervisor's embedded state store (server/state/socket.py)."""
        return str(Path(self.run_dir) / "state.sock")

    def sibling_address(self, index: int) -> str:
        """The gRPC address of worker `index`'s private server."""
        return "unix:" + self.sibling_socket(index)


def encode(message: dict[str, Any]) -> bytes:
    """One handshake line."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def spec_message(spec: WorkerSpec) -> bytes:
    """The supervisor's line to a worker."""
    return encode({"spec": asdict(spec)})


def read_line(sock: socket.socket) -> dict[str, Any] | None:
    """One JSON line read (blocking) from `sock`; None at end-of-file.

    Reads no byte past the line (peek, then take), so that a message sent right after it is left
    for the `DrainLink` that takes the socket over."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536, socket.MSG_PEEK)
        if not chunk:
            return None
        end = chunk.find(b"\n")
        data += sock.recv(end + 1 if end >= 0 else len(chunk))
        if len(data) > MAX_LINE_BYTES:
            raise ValueError("handshake line too long")
    return _decode(bytes(data))


def _decode(line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("handshake line is not an object")
    return message


class DrainLink:
    """The socket pair after the handshake, as asyncio streams of JSON lines (either end)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> DrainLink:
        """Take `sock` over (it becomes non-blocking)."""
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE_BYTES)
        return cls(reader, writer)

    async def receive(self) -> dict[str, Any] | None:
        """The next message; None at end-of-file (the other end exited or closed)."""
        try:
            line = await self._reader.readline()
        except (ConnectionError, ValueError):  # reset, or a line past the limit
            return None
        if not line.endswith(b"\n"):
            return None
        return _decode(line)

    def send(self, message: dict[str, Any]) -> None:
        """Queue `message` (the stream buffers it; a closed other end drops it: it is exiting)."""
        if self._writer.is_closing():
            return
        with contextlib.suppress(ConnectionError):
            self._writer.write(encode(message))

    def close(self) -> None:
        """Close this end (the other end sees end-of-file)."""
        self._writer.close()


def worker_socket() -> socket.socket | None:
    """This process's end of the pair when it is a worker (the variable is removed, so that a
    process this worker starts is not mistaken for one)."""
    value = os.environ.pop(WORKER_FD_VARIABLE, None)
    if value is None:
        return None
    return socket.socket(fileno=int(value))


def read_spec(sock: socket.socket) -> WorkerSpec:
    """The worker's spec, read from its supervisor (blocking, once at start)."""
    message = read_line(sock)
    if message is None or "spec" not in message:
        raise RuntimeError("the supervisor closed the worker channel before sending the spec")
    return WorkerSpec(**message["spec"])
