"""``SimEngine``: one simulated vLLM server on 127.0.0.1, as an async context manager.

It owns an ``EngineCore`` that survives ``stop()``/``start()``: a restarted engine comes back on
the same port with its counters, weight version and fault switches intact, which is what
failover and recovery tests need (the in-flight requests of a stopped engine are aborted and their
connections closed, as when a vLLM process dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Sequence
from types import TracebackType

from aiohttp import web

from .app import AppExtension, create_app
from .config import FaultConfig, SimConfig
from .core import EngineCore, SimStats


class SimEngine:
    """``async with SimEngine(SimConfig(...)) as eng: ... eng.url ...``"""

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        extensions: Sequence[AppExtension] = (),
    ) -> None:
        """``extensions`` add routes to the app before it serves (see ``create_app``)."""
        self.config = config if config is not None else SimConfig()
        self.host = host
        self._port = port
        self.core = EngineCore(self.config)
        self.app = create_app(self.config, core=self.core, extensions=extensions)
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> SimEngine:
        """Serve (again). The first start binds an OS-assigned port unless one was given."""
        if self._runner is not None:
            return self
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._port))
        except OSError:
            sock.close()
            await runner.cleanup()
            raise
        sock.listen(1024)
        sock.setblocking(False)
        self._port = sock.getsockname()[1]
        site = web.SockSite(runner, sock, backlog=2048)  # aiohttp: 128; uvicorn (vLLM): 2048
        await site.start()
        self._runner, self._site = runner, site
        return self

    async def stop(self) -> None:
        """Stop serving: abort in-flight requests, close connections, release the port."""
        runner = self._runner
        if runner is None:
            return
        self._runner = self._site = None
        server = runner.server
        if server is not None:
            # Like a dying process: open connections drop without an answer.
            for conn in list(server.connections):
                transport = conn.transport
                if transport is not None:
                    transport.abort()
        self.core.abort_all()
        self.core.resume()  # release held/frozen requests so they can finish as aborted
        await asyncio.sleep(0)
        with contextlib.suppress(Exception):
            await runner.cleanup()

    async def __aenter__(self) -> SimEngine:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ------------------------------------------------------------------ accessors
    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    @property
    def stats(self) -> SimStats:
        return self.core.stats

    @property
    def faults(self) -> FaultConfig:
        return self.config.faults

    def set_dead(self, dead: bool = True) -> None:
        """``/health`` answers 503 and generate 500 while dead (vLLM's ``EngineDeadError``)."""
        self.config.faults.dead = dead

    def reset_stats(self) -> None:
        """Zero the counters (between phases of a test)."""
        self.core.reset_stats()

    async def wait_for_tokens(self, request_id: str, k: int) -> None:
        """Wait until engine request ``request_id`` (prefixed id) has produced ``k`` tokens."""
        await self.core.wait_for_tokens(request_id, k)

    async def wait_for_running(self, n: int) -> None:
        await self.core.wait_until(lambda: len(self.core.running) >= n)

    async def wait_for_held(self, n: int) -> None:
        await self.core.wait_until(lambda: len(self.core.held) >= n)

    async def wait_idle(self) -> None:
        await self.core.wait_until(lambda: not self.core.requests)
