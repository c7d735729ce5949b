"""Listening ports: a port that cannot be had is one clear error, never a shared or silent one.

gRPC core binds with `SO_REUSEPORT` by default, so a second replica started on a busy port would
"serve" and the kernel would split connections between two processes with different engines (a
trainer could pause one while its generations run on the other). The replica's gRPC servers are
built with `grpc.so_reuseport` off (`NO_REUSEPORT`), and every bind failure — gRPC, health, the
OpenAI front door, metrics — becomes `PortUnavailable`, one line naming the port, what it is for
and the operating system's reason, which `rollout-grpc serve` prints before exiting non-zero.
"""

from __future__ import annotations

import errno
import os
import socket

#: The gRPC server option that makes a busy port a bind error instead of a shared port.
NO_REUSEPORT = ("grpc.so_reuseport", 0)


class PortUnavailable(OSError):
    """A port the replica was asked to listen on cannot be had."""


def _reason(host: str, port: int) -> str:
    """Why `host:port` cannot be bound, asked of the operating system with a plain socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return _describe(exc)
    return "the bind failed, but the port is free now (it was taken and released, or the address is invalid)"


def _describe(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "address already in use: another process is listening there (`ss -ltnp` names it)"
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "the address is not one of this host's"
    return os.strerror(exc.errno) if exc.errno else str(exc)


def unavailable(what: str, host: str, port: int, exc: OSError | None = None) -> PortUnavailable:
    """The error for a port that could not be bound; `exc` is the bind's own error when it has one."""
    reason = _describe(exc) if exc is not None and exc.errno else _reason(host, port)
    return PortUnavailable(f"cannot listen on {host}:{port} ({what}): {reason}")
