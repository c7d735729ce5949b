"""The supervisor <-> worker channel: one socket pair per worker, JSON lines, never a CLI argument.

The supervisor starts each worker as a subprocess of the same console script (so the worker parses
exactly the flags, environment and config file the supervisor parsed) and names the inherited end
of the pair in `WORKER_FD_VARIABLE`. It writes one `WorkerSpec` line (port, index, the run
directory, the per-start sibling secret, the engines); the worker answers one line, `ready` (with
its pid and side ports) or `error` (one message, printed by the supervisor). The pair then stays
open: its end-of-file tells a worker that its supervisor is gone (it stops, gracefully).
"""

from __future__ import annotations

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

    def sibling_socket(self, index: int) -> str:
        """The unix socket path of worker `index`."""
        return str(Path(self.run_dir) / f"worker-{index}.sock")

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
    """One JSON line read (blocking) from `sock`; None at end-of-file."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
        if len(data) > MAX_LINE_BYTES:
            raise ValueError("handshake line too long")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("handshake line is not an object")
    return message


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
