"""The worker port: reserved by the supervisor, shared by its workers only, watched for strangers.

Every other bind of the replica keeps `grpc.so_reuseport=0` (ports.py), so a busy port stays an
error. The workers must share one port, which needs SO_REUSEPORT on their listeners; joining a
port with it would also let this replica join someone else's. So the supervisor first binds a
plain socket WITHOUT SO_REUSEPORT: a port anyone listens on fails there (today's one-line error),
and port 0 gets one from the kernel. It then holds a bound, never-listening socket WITH
SO_REUSEPORT on the port for as long as it runs, so that the workers (same user, SO_REUSEPORT on)
can bind it while a second `rollout-grpc serve` on that port fails at its own plain bind. A socket
that does not listen receives no connections.

What SO_REUSEPORT cannot prevent is another process of the same user that binds the port with
SO_REUSEPORT too (the kernel would hand it a share of the connections). `foreign_listeners`
compares the listening sockets on the port (/proc/net/tcp and tcp6, state LISTEN) with the socket
inodes the workers hold (/proc/<pid>/fd): at startup a stranger is fatal, later it is logged and
counted (`rollout_grpc_foreign_listeners`).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from rollout_grpc.server import ports

#: /proc/net/tcp's state code of a listening socket.
TCP_LISTEN = "0A"
PROC_NET_TCP = ("/proc/net/tcp", "/proc/net/tcp6")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class PortReservation:
    """The supervisor's hold on the workers' port (a context manager; `close()` releases it)."""

    def __init__(self, host: str, port: int, what: str = "gRPC, --port") -> None:
        """Reserve `port` on `host`; PortUnavailable naming `what` (the port and its flag)."""
        self.host = host
        family = _family(host)
        address = host.strip("[]")
        probe = socket.socket(family, socket.SOCK_STREAM)
        try:
            # As gRPC binds (SO_REUSEADDR on, SO_REUSEPORT off): a listening socket, of anyone,
            # makes this fail; a port in TIME_WAIT does not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError as exc:
                raise ports.unavailable(what, host, port, exc) from None
            self.port = int(probe.getsockname()[1])
        finally:
            probe.close()
        self._hold = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self._hold.bind((address, self.port))
        except OSError as exc:
            # Someone took the port between the probe and the hold.
            self._hold.close()
            raise ports.unavailable(what, host, self.port, exc) from None

    def close(self) -> None:
        """Release the port (after the workers have stopped)."""
        self._hold.close()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def listening_inodes(port: int, tables: Iterable[str] = PROC_NET_TCP) -> set[int]:
    """Inodes of every TCP socket listening on `port` (any address), from /proc/net/tcp{,6}."""
    inodes: set[int] = set()
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            local_port = int(fields[1].rpartition(":")[2], 16)
            if local_port == port:
                inodes.add(int(fields[9]))
    return inodes


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds (empty when it is gone)."""
    inodes: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError as exc:  # closed meanwhile
            if exc.errno in (errno.ENOENT, errno.EACCES):
                continue
            raise
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def foreign_listeners(port: int, worker_pids: Iterable[int]) -> set[int]:
    """Inodes of sockets listening on `port` that none of `worker_pids` holds."""
    ours: set[int] = set()
    for pid in worker_pids:
        ours |= socket_inodes(pid)
    return listening_inodes(port) - ours
