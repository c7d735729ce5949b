"""One scrape shows every worker: the supervisor's /metrics merges the workers' registries.

Each worker answers `WorkerService.Scrape` on its private socket with its own exposition; the
supervisor parses them, adds a `worker` label to every sample and renders one exposition, family
by family, with its own series (`rollout_grpc_workers`, `rollout_grpc_worker_up`,
`rollout_grpc_foreign_listeners`). prometheus_client's multiprocess mode does not fit: it covers only
the library's own metric types written to mmap files, not the custom collectors that read live
state (engines, admission) at scrape time. Sum over workers with `sum without(worker) (...)`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast

import grpc
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.server.workers.handshake import SIBLING_METADATA_KEY

log = structlog.get_logger(__name__)

#: Longest a scrape waits for one worker (a worker that does not answer is left out, `up` 0).
SCRAPE_TIMEOUT_S = 5.0


def merge(expositions: Sequence[tuple[int, str]], extra: Iterable[Metric] = ()) -> list[Metric]:
    """The families of every `(worker index, exposition)`, each sample labelled `worker`."""
    families: dict[str, Metric] = {}
    for index, text in expositions:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(
                Sample(s.name, {**s.labels, "worker": str(index)}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    return [*families.values(), *extra]


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(families: list[Metric]) -> bytes:
    """The text exposition of `families`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    return generate_latest(registry)


class WorkerScraper:
    """Channels to the workers' private servers, for scrapes."""

    def __init__(self, addresses: Sequence[str], secret: str) -> None:
        self._channels = [grpc.aio.insecure_channel(a) for a in addresses]
        self._stubs = [pb_grpc.WorkerServiceStub(c) for c in self._channels]
        self._metadata = ((SIBLING_METADATA_KEY, secret),)

    async def scrape(self) -> list[tuple[int, str]]:
        """Every answering worker's exposition."""

        async def one(stub: pb_grpc.WorkerServiceStub) -> pb.ScrapeResponse:
            call = stub.Scrape(pb.ScrapeRequest(), timeout=SCRAPE_TIMEOUT_S, metadata=self._metadata)
            return await cast("asyncio.Future[pb.ScrapeResponse]", call)

        results = await asyncio.gather(*(one(s) for s in self._stubs), return_exceptions=True)
        answered: list[tuple[int, str]] = []
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                log.warning("worker_scrape_failed", worker=index, error=str(result))
            else:
                answered.append((index, result.text.decode()))
        return answered

    async def close(self) -> None:
        """Close the channels."""
        await asyncio.gather(*(c.close() for c in self._channels))


def supervisor_families(workers: int, up: set[int], foreign: int) -> list[Metric]:
    """The supervisor's own series."""
    count = Metric("rollout_grpc_workers", "Worker processes of this replica (serve --workers).", "gauge")
    count.add_sample("rollout_grpc_workers", {}, float(workers))
    alive = Metric("rollout_grpc_worker_up", "1 when the worker answered this scrape.", "gauge")
    for index in range(workers):
        alive.add_sample("rollout_grpc_worker_up", {"worker": str(index)}, 1.0 if index in up else 0.0)
    strangers = Metric(
        "rollout_grpc_foreign_listeners",
        "Listening sockets on the gRPC port that no worker of this replica holds (should be 0).",
        "gauge",
    )
    strangers.add_sample("rollout_grpc_foreign_listeners", {}, float(foreign))
    return [count, alive, strangers]


class MergedMetricsEndpoint:
    """The supervisor's `/metrics` HTTP endpoint."""

    def __init__(self, scraper: WorkerScraper, workers: int, check_listeners: Callable[[], int]) -> None:
        self._scraper = scraper
        self._workers = workers
        #: The supervisor's listener check, run at every scrape too (cheap: /proc reads).
        self._check_listeners = check_listeners
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        expositions = await self._scraper.scrape()
        up = {index for index, _ in expositions}
        foreign = self._check_listeners()
        families = merge(expositions, supervisor_families(self._workers, up, foreign))
        return web.Response(body=render(families), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0 = a free port); the bound port."""
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=False)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
