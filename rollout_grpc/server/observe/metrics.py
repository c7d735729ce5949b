"""Prometheus metrics of one replica, and the HTTP endpoint that exposes them.

Every replica owns its `CollectorRegistry` (several replicas may share a process in tests). Values
come from three places, none of them inside the generation loop:

* the facade's call records (`facade/calls.py`), one per call of either door. gRPC calls: RPC counts
  by code and latency, TTFT, time per output token, end-to-end latency, queue wait, tokens,
  generations by final status, refusals, aborts by target, failovers, abort-all and pause
  durations. Front-door requests: requests by route and HTTP status, latency, TTFT and tokens
  (its turns' queue wait joins the shared queue histogram);
* the engine pool and admission, read at scrape time (`_StateCollector`): running, queued and
  limit, and per engine health, circuit breaker, paused, usable, capability problems, in flight and
  the current weight version (an info-style gauge). The `engine` label is the engine's opaque
  `engine-<8 hex>` label (security/redact.py), the one non-admin callers see: the endpoint has no
  authentication, and engine URLs are internal addresses (`--metrics-engine-urls` shows them,
  for a metrics port only admins reach). The label is stable across replicas and restarts; an
  admin's `GetServerInfo` or `rollout-grpc info` maps it back to the URL.

Names follow Prometheus conventions (`_total` counters, `_seconds` units, base units) with the
`rollout_grpc_` prefix; where vLLM has the same quantity (`vllm:time_to_first_token_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`,
`vllm:generation_tokens_total`, `vllm:num_requests_running`, `vllm:num_requests_waiting`) the
name after the prefix is vLLM's, so dashboards can put the service and its engines side by side.
RPC metrics follow go-grpc-prometheus (`grpc_server_handled_total{grpc_method,grpc_code}`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Final

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.facade.calls import CallRecord, Door
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.control import AbortResult, FleetResult
from rollout_grpc.server.security import redact

log = structlog.get_logger(__name__)

PREFIX: Final = "rollout_grpc_"
#: Latency buckets in seconds (vLLM's request-latency buckets, from 10 ms to 2 h).
_LATENCY_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, 7200.0,
)  # fmt: skip
#: TTFT buckets (vLLM's `time_to_first_token_seconds` buckets).
_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: Time-per-output-token buckets (vLLM's).
_TPOT_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_RPC_BUCKETS: Final = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


class Metrics:
    """The replica's metrics; `observe` is a listener of the facade's `CallBook`."""

    def __init__(self, pool: EnginePool, admission: Admission, *, engine_urls: bool = False) -> None:
        """`engine_urls`: label engine series with the engine URLs; by default with the opaque
        `engine-<8 hex>` labels that non-admin callers see (the endpoint has no authentication)."""
        self._engine_urls = engine_urls
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.handled = Counter(
            PREFIX + "grpc_server_handled",
            "RPCs completed on the server, by method and status code.",
            ["grpc_method", "grpc_code"],
            registry=r,
        )
        self.handling = Histogram(
            PREFIX + "grpc_server_handling_seconds",
            "RPC latency on the server (a Generate counts until its last message).",
            ["grpc_method"],
            buckets=_RPC_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Generate: time from the call's start to the engine's first token (final_only calls too).",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Generate: (latency - TTFT) / (new tokens - 1), per generation of at least 2 tokens.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Generate: end-to-end latency of generations that returned a sample.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Generate: time waiting for an admission slot.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated (returned in final samples).", registry=r
        )
        self.generations = Counter(
            PREFIX + "generations",
            "Generate calls by outcome: the final sample's status, or the gRPC code when none was returned.",
            ["status"],
            registry=r,
        )
        self.rejections = Counter(
            PREFIX + "admission_rejections",
            "Generate calls refused with RESOURCE_EXHAUSTED (queue full).",
            registry=r,
        )
        self.aborts = Counter(PREFIX + "aborts", "Abort RPCs by target.", ["target"], registry=r)
        self.aborted = Counter(
            PREFIX + "aborted_generations",
            "Generations on this replica ended by Abort RPCs, by target.",
            ["target"],
            registry=r,
        )
        self.failovers = Counter(
            PREFIX + "failovers",
            "Generations continued on another engine after an engine call failed.",
            registry=r,
        )
        self.abort_all = Histogram(
            PREFIX + "abort_all_duration_seconds",
            "Abort(all): duration of the abort-all window (pause(abort) on every engine, then resume).",
            buckets=_RPC_BUCKETS,
            registry=r,
        )
        self.pause = Histogram(
            PREFIX + "pause_duration_seconds",
            "Time from a successful Pause to the next successful Resume through this replica.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_groups = Counter(
            PREFIX + "step_groups",
            "RolloutStep groups that ended, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.step_version_lag = Histogram(
            PREFIX + "step_version_lag",
            "RolloutStep: weight versions between an accepted sample's first token and the newest version.",
            buckets=(0, 1, 2, 3, 4, 8, 16),
            registry=r,
        )
        self.openai_requests = Counter(
            PREFIX + "openai_requests",
            "OpenAI front-door requests by route and HTTP status (refusals by auth included).",
            ["route", "code"],
            registry=r,
        )
        self.openai_latency = Histogram(
            PREFIX + "openai_request_duration_seconds",
            "OpenAI front door: time from a request's arrival to its last byte, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.openai_ttft = Histogram(
            PREFIX + "openai_time_to_first_token_seconds",
            "OpenAI front door: time from a chat completion's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.openai_tokens = Counter(
            PREFIX + "openai_generation_tokens",
            "Tokens generated by front-door chat completions.",
            registry=r,
        )
        self._paused_since: float | None = None
        self.paused_engines: set[str] = set()
        #: The labelled children the per-call accounting uses, by (metric, label values): a
        #: `labels()` lookup validates and joins the values under the metric's lock on every call
        #: (three per Generate); a child, once made, is the same object for the metric's life.
        self._children: dict[tuple[object, ...], Any] = {}
        r.register(_StateCollector(pool, admission, self))

    def observe(self, record: CallRecord) -> None:
        """Account one finished call of either door."""
        if record.door is Door.OPENAI:
            self._observe_front_door(record)
            return
        self._child(self.handled, record.method, record.code).inc()
        self._child(self.handling, record.method).observe(record.duration_s)
        if record.method == "Generate":
            self._observe_generate(record)
        elif record.method == "RolloutStep":
            self._observe_step(record)
        elif record.code == "OK":
            if record.method == "Abort":
                self._observe_abort(record)
            elif record.method == "Pause":
                self._observe_pause(record.result)
            elif record.method == "Resume":
                self._observe_resume(record.result)

    def _child(self, metric: Counter | Histogram, *values: str) -> Any:
        """`metric.labels(*values)`, made once (the label values of a call are a small set:
        methods, codes, statuses). Nothing removes a child of these metrics."""
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def _observe_front_door(self, record: CallRecord) -> None:
        self.openai_requests.labels(record.method, str(record.http_status or 200)).inc()
        self.openai_latency.labels(record.method).observe(record.duration_s)
        if record.ttft_s is not None:
            self.openai_ttft.observe(record.ttft_s)
        self.openai_tokens.inc(record.new_tokens)
        if record.queue_wait_s is not None:
            self.queue.observe(record.queue_wait_s)

    def _observe_step(self, record: CallRecord) -> None:
        """A step's groups, tokens and lags (whatever its end: a step that failed half-way counts
        what it did)."""
        for outcome, count in record.step_groups.items():
            self.step_groups.labels(outcome).inc(count)
        self.tokens.inc(record.step_tokens)
        for lag in record.version_lags:
            self.step_version_lag.observe(lag)

    def _observe_generate(self, record: CallRecord) -> None:
        self._child(self.generations, record.status).inc()
        if record.code == "RESOURCE_EXHAUSTED":
            self.rejections.inc()
        if record.queue_wait_s is not None:
            self.queue.observe(record.queue_wait_s)
        if record.sample is None:
            return
        tokens = record.new_tokens
        self.tokens.inc(tokens)
        self.e2e.observe(record.duration_s)
        self.failovers.inc(max(0, len(record.engines) - 1))
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
            if tokens >= 2:
                self.tpot.observe((record.duration_s - record.ttft_s) / (tokens - 1))

    def _observe_abort(self, record: CallRecord) -> None:
        target = record.abort_target or "none"
        if target == "all":
            self.abort_all.observe(record.duration_s)
        self.aborts.labels(target).inc()
        if isinstance(record.result, AbortResult):
            self.aborted.labels(target).inc(record.result.aborted)

    def _observe_pause(self, result: object) -> None:
        if isinstance(result, FleetResult) and result.ok:
            self.paused_engines.update(result.ok)
            if self._paused_since is None:
                self._paused_since = time.monotonic()

    def _observe_resume(self, result: object) -> None:
        if isinstance(result, FleetResult):
            self.paused_engines.difference_update(result.ok)
            if self._paused_since is not None and not self.paused_engines:
                self.pause.observe(time.monotonic() - self._paused_since)
                self._paused_since = None

    def exposition(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)

    def engine_name(self, url: str) -> str:
        """The `engine` label value of `url`: the URL itself only when asked for."""
        return url if self._engine_urls else redact.engine_label(url)


class _StateCollector(Collector):
    """Gauges read from the pool and admission at scrape time (always current, no bookkeeping)."""

    def __init__(self, pool: EnginePool, admission: Admission, metrics: Metrics) -> None:
        self._pool = pool
        self._admission = admission
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            PREFIX + "num_requests_running", "Generations holding an admission slot.", self._admission.running
        )
        yield GaugeMetricFamily(
            PREFIX + "num_requests_waiting",
            "Generations waiting for an admission slot.",
            self._admission.queued,
        )
        yield GaugeMetricFamily(
            PREFIX + "admission_limit", "Generations that may run at once.", self._admission.limit
        )
        labels = ["engine"]
        families = {
            "healthy": GaugeMetricFamily(
                PREFIX + "engine_healthy", "1 when the engine's health probe succeeds.", labels=labels
            ),
            "breaker": GaugeMetricFamily(
                PREFIX + "engine_breaker_open",
                "1 while the engine's circuit breaker keeps it out after failed calls.",
                labels=labels,
            ),
            "paused": GaugeMetricFamily(
                PREFIX + "engine_paused", "1 when the engine was paused through this replica.", labels=labels
            ),
            "usable": GaugeMetricFamily(
                PREFIX + "engine_usable", "1 when the engine receives new generations.", labels=labels
            ),
            "problems": GaugeMetricFamily(
                PREFIX + "engine_capability_problems",
                "Reasons the engine cannot serve the contract (GetServerInfo lists them).",
                labels=labels,
            ),
            "in_flight": GaugeMetricFamily(
                PREFIX + "engine_in_flight", "Generations this replica has on the engine.", labels=labels
            ),
        }
        version = GaugeMetricFamily(
            PREFIX + "engine_weight_version_info",
            "The engine's current weight version (as label; value 1).",
            labels=["engine", "weight_version"],
        )
        paused = self._metrics.paused_engines
        for engine in self._pool.engines:
            url = [self._metrics.engine_name(engine.url)]
            families["healthy"].add_metric(url, float(engine.healthy))
            families["breaker"].add_metric(url, float(not engine.healthy and engine.consecutive_failures > 0))
            families["paused"].add_metric(url, float(engine.url in paused))
            families["usable"].add_metric(url, float(engine.usable))
            families["problems"].add_metric(url, float(len(engine.problems)))
            families["in_flight"].add_metric(url, float(engine.in_flight))
            if engine.weight_version:
                version.add_metric([url[0], engine.weight_version], 1.0)
        yield from families.values()
        yield version


class MetricsEndpoint:
    """`GET /metrics` over HTTP on its own port (aiohttp, in the replica's event loop)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _handle(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 = any free port); returns the bound port."""
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else port
        log.info("metrics_serving", port=self.port)
        return self.port

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
