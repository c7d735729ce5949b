"""A `serve --workers N` replica in a subprocess, and clients that know which worker they reach.

The kernel hands each TCP connection to one worker, so a test that must place streams on a given
worker opens connections until it has one per worker (`clients_by_worker`): each connection asks
GetServerInfo which worker answered (`GetServerInfoResponse.worker`). The OpenAI front door's
connections (`http_by_worker`) are placed the same way, the worker read from the kernel: the
process holding the accepted socket of the connection (/proc/net/tcp and /proc/<pid>/fd).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client import AsyncRolloutClient, make_sample
from rollout_grpc.server.workers.reservation import PROC_NET_TCP, socket_inodes
from tests.support.processes import (
    Proc,
    Processes,
    free_ports,
    fresh_port_file,
    read_port_file,
    replica_command,
)

#: Connections tried before giving up on reaching every worker (each lands on a random worker).
MAX_CONNECTIONS = 64
#: A stream that runs until it is aborted (ignore_eos; the simulated engines' token delay paces it).
LONG: dict[str, Any] = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}


@dataclass
class Replica:
    """A running supervisor and what its port file says."""

    proc: Proc
    ports: dict[str, Any]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"


def start_replica(procs: Processes, workdir: Path, *args: str, name: str = "replica") -> Replica:
    """`rollout-grpc serve --port 0 <args>`, ready once its port file exists."""
    port_file = fresh_port_file(workdir / f"{name}.ports.json")
    proc = procs.start(
        name,
        [
            *replica_command(),
            "serve",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--log-format",
            "json",
            *args,
        ],
    )
    return Replica(proc, json.loads(read_port_file(port_file, proc)))


def client(target: str, token: str | None = None) -> AsyncRolloutClient:
    """A client with a connection of its own (not shared with other clients' channels)."""
    return AsyncRolloutClient(
        target, options=[("grpc.use_local_subchannel_pool", 1)], retry=None, token=token
    )


@contextlib.asynccontextmanager
async def clients_by_worker(
    target: str, workers: int, token: str | None = None
) -> AsyncIterator[dict[int, AsyncRolloutClient]]:
    """One client per worker index, each with a connection that worker serves."""
    found: dict[int, AsyncRolloutClient] = {}
    opened: list[AsyncRolloutClient] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            candidate = client(target, token)
            opened.append(candidate)
            info = await candidate.server_info()
            assert info.workers == workers, info
            found.setdefault(info.worker, candidate)
            if len(found) == workers:
                break
        assert len(found) == workers, f"{MAX_CONNECTIONS} connections reached only workers {sorted(found)}"
        yield found
    finally:
        await asyncio.gather(*(c.close() for c in opened))


def accepting_worker(ports: dict[str, Any], server_port: int, client_port: int) -> int:
    """The index of the worker holding the server side of the loopback connection from
    `client_port` to `server_port` (-1: no worker holds it)."""
    inodes: set[int] = set()
    for table in PROC_NET_TCP:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, remote = fields[1].rpartition(":")[2], fields[2].rpartition(":")[2]
            if int(local, 16) == server_port and int(remote, 16) == client_port:
                inodes.add(int(fields[9]))
    for index, pid in enumerate(ports["worker_pids"]):
        if inodes & socket_inodes(pid):
            return index
    return -1


def front_door_session() -> tuple[aiohttp.ClientSession, int]:
    """An HTTP session with one keep-alive connection from a local port of its own (known, so
    that `accepting_worker` finds which worker accepted it)."""
    (port,) = free_ports(1)
    connector = aiohttp.TCPConnector(limit=1, local_addr=("127.0.0.1", port))
    return aiohttp.ClientSession(connector=connector), port


async def front_door_worker(ports: dict[str, Any], http: aiohttp.ClientSession, client_port: int) -> int:
    """Which worker serves `http`'s connection (from `client_port`) to the OpenAI port, after a
    GET /v1/models on it."""
    async with http.get(f"http://127.0.0.1:{ports['openai']}/v1/models") as reply:
        assert reply.status == 200, await reply.text()
        await reply.read()
    return accepting_worker(ports, int(ports["openai"]), client_port)


@contextlib.asynccontextmanager
async def http_by_worker(
    ports: dict[str, Any], workers: int
) -> AsyncIterator[dict[int, tuple[aiohttp.ClientSession, int]]]:
    """One HTTP session (and its local port) per worker index, each with its one keep-alive
    connection to the front door served by that worker."""
    found: dict[int, tuple[aiohttp.ClientSession, int]] = {}
    opened: list[aiohttp.ClientSession] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            http, port = front_door_session()
            opened.append(http)
            found.setdefault(await front_door_worker(ports, http, port), (http, port))
            if len(found.keys() - {-1}) == workers:
                break
        assert len(found.keys() - {-1}) == workers, (
            f"{MAX_CONNECTIONS} connections to the OpenAI port reached only workers {sorted(found)}"
        )
        yield found
    finally:
        await asyncio.gather(*(h.close() for h in opened))


class Streams:
    """Long Generate streams on one client; each records its messages and its final sample."""

    def __init__(self, on: AsyncRolloutClient, params: dict[str, Any] | None = None) -> None:
        self._client = on
        self._params = params or LONG
        self.tasks: list[asyncio.Task[pb.Sample | None]] = []
        self.started: list[asyncio.Event] = []

    def start(self, count: int, prefix: str, *, session_id: str = "", group_index: int = 0) -> list[str]:
        """Start `count` streams with request ids `<prefix>-<i>`; their ids."""
        ids = [f"{prefix}-{i}" for i in range(count)]
        for rid in ids:
            event = asyncio.Event()
            self.started.append(event)
            sample = make_sample([1, 2, 3, 4], session_id=session_id, group_index=group_index)
            self.tasks.append(asyncio.ensure_future(self._run(sample, rid, event)))
        return ids

    async def _run(self, sample: pb.Sample, rid: str, started: asyncio.Event) -> pb.Sample | None:
        async for message in self._client.generate_stream(
            sample, self._params, {"stream_batch_tokens": 1}, request_id=rid
        ):
            started.set()
            if message.HasField("sample"):
                return message.sample
        return None

    async def running(self, timeout: float = 30.0) -> None:
        """Until every stream has received its first tokens."""
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(e.wait() for e in self.started))

    async def finals(self, timeout: float = 60.0) -> Sequence[pb.Sample | None]:
        """Every stream's final sample."""
        async with asyncio.timeout(timeout):
            return await asyncio.gather(*self.tasks)


async def wait_admitted(on: AsyncRolloutClient, running: int, queued: int, timeout: float = 30.0) -> None:
    """Until the worker `on` reaches holds `running` generations and `queued` more."""
    async with asyncio.timeout(timeout):
        while True:
            info = await on.server_info()
            if info.in_flight >= running and info.queued >= queued:
                return
            await asyncio.sleep(0.02)
