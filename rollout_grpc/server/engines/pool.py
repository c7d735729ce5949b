"""The engine pool: which engine serves a generation, and which engines are usable.

* Routing: least outstanding requests; samples with a session id go to the session's engine chosen
  by rendezvous (highest-random-weight) hashing with bounded load, so every replica that has the
  same engine list makes the same choice, and a hot session spills over instead of overloading
  one engine (Mirrokni et al., "Consistent Hashing with Bounded Loads").
* Health: a periodic `/health` probe plus passive failure detection; a per-engine circuit breaker
  keeps a failed engine out of rotation until a probe succeeds again. A failed probe is also told
  to the engine calls in flight on that engine (`EngineHandle.watch`), so that streams silent
  since the probe began fail over at once instead of waiting for the idle timeout.
* Membership: engines can be added, drained (no new generations; in-flight ones finish) and removed
  at runtime, e.g. from a file re-read on SIGHUP.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import structlog

from rollout_grpc.server.engines.api import EngineAdapter, EngineCapabilities

log = structlog.get_logger(__name__)

#: An engine may take this factor above the average in-flight load before a session spills over.
BOUNDED_LOAD_FACTOR = 1.25


@dataclass(slots=True, eq=False)
class EngineHandle:
    """One engine and what this replica knows about it."""

    url: str
    client: EngineAdapter
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    consecutive_failures: int = 0
    last_error: str = ""
    weight_version: str = ""
    model: str = ""
    #: Observed seconds per generated token per request (EWMA), None until measured. Sizes the
    #: `stream_interval` asked of the engine so that its batching never outlasts the time flush.
    token_gap_s: float | None = None

    def observe_token_gap(self, seconds: float, tokens: int) -> None:
        """Fold one request's decode speed into the estimate (requests of >= 8 tokens)."""
        if tokens >= 8:
            gap = seconds / tokens
            self.token_gap_s = gap if self.token_gap_s is None else 0.8 * self.token_gap_s + 0.2 * gap

    _opened_at: float = field(default=0.0, repr=False)
    #: Why the engine cannot serve the contract (each names the vLLM flag to add); set by the
    #: capability check (`capabilities.py`). An engine with problems receives no generations.
    problems: list[str] = field(default_factory=list)
    #: What the capability check found (`capabilities.py`), None before it (or after a failed
    #: check). The one source of the engine's capability facts.
    capabilities: EngineCapabilities | None = None
    #: Why this engine's weights are not the fleet's (a weight update failed on it, or it was not
    #: paused for one): no generations until a later update loads on it (`rollout/weights/`).
    #: Kept apart from `problems`, which the capability check rewrites.
    weights_problem: str = ""
    #: The engine calls in flight on this engine that want to hear when a health probe finds it
    #: dead (`watch`): each is called with the time the failed probe started.
    _watchers: set[Callable[[float], None]] = field(default_factory=set, repr=False)

    @property
    def usable(self) -> bool:
        """Healthy, not draining and able to serve the contract: may receive new generations."""
        return self.healthy and not self.draining and not self.problems and not self.weights_problem

    def watch(self, on_dead: Callable[[float], None]) -> Callable[[], None]:
        """Call `on_dead(probe_started)` whenever a health probe of this engine fails (every
        time, not only when it turns unhealthy: a call that started after one failed probe
        hears the next). Returns the function that stops watching.

        Why: a stopped engine (SIGSTOP, a wedged GPU) fails its probe within seconds, while its
        streams would otherwise wait for the idle timeout (30 s) — longer than trainers' deadlines.
        """
        self._watchers.add(on_dead)
        return lambda: self._watchers.discard(on_dead)

    def declare_dead(self, probe_started: float) -> None:
        """Tell the watching engine calls that a probe begun at `probe_started` got no answer."""
        for on_dead in list(self._watchers):
            on_dead(probe_started)


def _rendezvous_weight(key: str, url: str) -> int:
    """A stable pseudo-random weight of (key, engine); the same on every replica and run."""
    digest = hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class EnginePool:
    """The engines of this replica, their health and the routing decision."""

    def __init__(
        self,
        urls: Iterable[str],
        adapter: Callable[[str], EngineAdapter],
        *,
        health_interval_s: float = 2.0,
        failure_threshold: int = 1,
        breaker_cooldown_s: float = 5.0,
        capability_check: Callable[[EngineHandle], Awaitable[None]] | None = None,
    ) -> None:
        """`adapter` builds the adapter of a new engine URL (`registry.adapter_factory` in a
        replica, a fake engine in tests): the pool never names an engine kind. `capability_check`
        classifies an engine (sets its `problems`; `capabilities.CapabilityChecker` in a replica):
        the engines given here at `probe_all`, an engine that joins at once, one that comes back
        healthy at that probe."""
        self._adapter = adapter
        self._health_interval_s = health_interval_s
        self._failure_threshold = failure_threshold
        self._breaker_cooldown_s = breaker_cooldown_s
        self._engines: dict[str, EngineHandle] = {}
        self._health_task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[bool], None]] = []
        self._rr = 0
        self._capability_check: Callable[[EngineHandle], Awaitable[None]] | None = None
        self._joining: set[asyncio.Task[bool]] = set()
        for url in urls:
            self.add(url)
        # Set after the first engines are added: they are checked together by `probe_all`.
        self._capability_check = capability_check

    # ----------------------------------------------------------------------------- membership

    @property
    def engines(self) -> list[EngineHandle]:
        """All engines, in insertion order."""
        return list(self._engines.values())

    def get(self, url: str) -> EngineHandle | None:
        """The engine with this base URL, if in the pool."""
        return self._engines.get(url.rstrip("/"))

    def add(self, url: str) -> EngineHandle:
        """Add an engine (idempotent; re-adding a draining engine un-drains it)."""
        url = url.rstrip("/")
        handle = self._engines.get(url)
        if handle is None:
            handle = EngineHandle(url=url, client=self._adapter(url))
            self._engines[url] = handle
            log.info("engine_added", engine=url)
            if self._capability_check is not None:
                # Not routed to until checked; the check starts now, not at the next probe.
                handle.problems = ["capabilities not checked yet"]
                with contextlib.suppress(RuntimeError):  # no running loop: the first probe checks
                    task = asyncio.get_running_loop().create_task(self.probe(handle))
                    self._joining.add(task)
                    task.add_done_callback(self._joining.discard)
        handle.draining = False
        self._notify()
        return handle

    def drain(self, url: str) -> None:
        """Stop sending new generations to an engine; in-flight ones finish."""
        handle = self.get(url)
        if handle is not None:
            handle.draining = True
            log.info("engine_draining", engine=handle.url)
            self._notify()

    def relabel(self, handle: EngineHandle, weight_version: str) -> None:
        """`handle`'s engine serves `weight_version` (it said so, or a sibling worker relabelled it)."""
        handle.weight_version = weight_version

    def name_model(self, handle: EngineHandle, model: str) -> None:
        """The model `handle`'s engine serves, as its /v1/models lists it."""
        handle.model = model

    def set_weights_problem(self, handle: EngineHandle, problem: str) -> None:
        """Take `handle` out of rotation because of its weights (`problem`), or, with "",
        re-admit it after a successful load (`rollout/weights/`)."""
        if handle.weights_problem != problem:
            handle.weights_problem = problem
            if problem:
                log.warning("engine_out_of_rotation", engine=handle.url, reason=problem)
            else:
                log.info("engine_readmitted", engine=handle.url)
            self._notify()

    def remove(self, url: str) -> None:
        """Forget an engine (its in-flight generations keep their own reference and finish)."""
        if self._engines.pop(url.rstrip("/"), None) is not None:
            log.info("engine_removed", engine=url)
            self._notify()

    def replace(self, urls: Iterable[str]) -> None:
        """Make the pool `urls`: add new engines, drain the others (removed once idle)."""
        wanted = [u.rstrip("/") for u in urls]
        for url in wanted:
            self.add(url)
        for url in list(self._engines):
            if url not in wanted:
                self.drain(url)
        self._remove_drained()

    def _remove_drained(self) -> None:
        """Forget draining engines that have nothing in flight any more."""
        for handle in list(self._engines.values()):
            if handle.draining and handle.in_flight == 0:
                self.remove(handle.url)

    # ----------------------------------------------------------------------------- routing

    def unusable_reasons(self) -> list[tuple[str, str]]:
        """(URL, why) for every engine that receives no generations now: the health probe's cause,
        the capability problems, or draining. Named in UNAVAILABLE messages and GetServerInfo."""
        reasons: list[tuple[str, str]] = []
        for handle in self._engines.values():
            if not handle.healthy:
                reasons.append((handle.url, f"unhealthy: {handle.last_error or 'health probe failed'}"))
            elif handle.problems:
                reasons.append((handle.url, "not usable: " + "; ".join(handle.problems)))
            elif handle.weights_problem:
                reasons.append((handle.url, "out of rotation: " + handle.weights_problem))
            elif handle.draining:
                reasons.append((handle.url, "draining"))
        return reasons

    def pick(
        self, session_id: str = "", exclude: frozenset[str] | set[str] = frozenset()
    ) -> EngineHandle | None:
        """Choose the engine for a new engine call, or None when no engine is usable."""
        candidates = [e for e in self._engines.values() if e.usable and e.url not in exclude]
        if not candidates:
            return None
        if session_id:
            total = sum(e.in_flight for e in candidates) + 1
            bound = math.ceil(BOUNDED_LOAD_FACTOR * total / len(candidates))
            ranked = sorted(candidates, key=lambda e: _rendezvous_weight(session_id, e.url), reverse=True)
            for engine in ranked:
                if engine.in_flight < bound:
                    return engine
            return ranked[0]
        least = min(e.in_flight for e in candidates)
        tied = [e for e in candidates if e.in_flight == least]
        self._rr = (self._rr + 1) % len(tied)
        return tied[self._rr]

    @contextlib.contextmanager
    def lease(self, handle: EngineHandle) -> Iterator[EngineHandle]:
        """Count one engine call against `handle` for routing while the block runs."""
        handle.in_flight += 1
        try:
            yield handle
        finally:
            handle.in_flight -= 1

    # ----------------------------------------------------------------------------- health

    def add_listener(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(any_usable)` whenever membership or health changes."""
        self._listeners.append(listener)
        listener(self.any_usable)

    @property
    def any_usable(self) -> bool:
        """At least one engine may receive generations."""
        return any(e.usable for e in self._engines.values())

    def _notify(self) -> None:
        state = self.any_usable
        for listener in self._listeners:
            listener(state)

    def report_failure(self, handle: EngineHandle, error: str) -> None:
        """Passive detection: an engine call failed to connect or broke mid-stream."""
        handle.consecutive_failures += 1
        handle.last_error = error
        if handle.healthy and handle.consecutive_failures >= self._failure_threshold:
            handle.healthy = False
            handle._opened_at = time.monotonic()
            log.warning("engine_unhealthy", engine=handle.url, error=error)
            self._notify()

    def report_success(self, handle: EngineHandle) -> None:
        """An engine call completed: reset the failure count."""
        handle.consecutive_failures = 0

    async def probe(self, handle: EngineHandle) -> bool:
        """Probe one engine's /health and update its state.

        An engine taken out by a failed call (circuit open) stays out for the breaker cooldown even
        if /health answers: an engine that accepts connections but breaks streams would otherwise
        flap back into rotation at every probe.
        """
        started = time.monotonic()
        health = await handle.client.health()
        ok = bool(health)
        cooling = handle.consecutive_failures > 0 and (
            time.monotonic() - handle._opened_at < self._breaker_cooldown_s
        )
        usable_before = handle.usable
        if (
            ok
            and self._capability_check is not None
            and (handle.capabilities is None or (not handle.healthy and not cooling))
        ):
            await self._capability_check(handle)
        if ok and not handle.healthy and not cooling:
            handle.healthy = True
            handle.consecutive_failures = 0
            log.info("engine_healthy", engine=handle.url)
            self._notify()
        elif not ok:
            cause = getattr(health, "cause", "") or "health probe failed"
            if handle.healthy or cause != handle.last_error:
                log.warning("engine_unhealthy", engine=handle.url, error=cause)
            handle.last_error = cause
            if handle.healthy:
                handle.healthy = False
                self._notify()
        if handle.usable != usable_before:
            self._notify()
        if not ok:
            handle.declare_dead(started)
        return ok

    async def probe_all(self) -> None:
        """Probe every engine concurrently; forget drained engines that became idle."""
        await asyncio.gather(*(self.probe(e) for e in list(self._engines.values())))
        self._remove_drained()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await self.probe_all()
            except Exception:  # a probe bug must not end health checking
                log.exception("health_probe_failed")

    def start(self) -> None:
        """Start periodic health probes, the first one interval from now: the caller has just
        probed every engine (`probe_all`), and a second probe at once only doubles the startup's
        requests (and puts one in flight as the first calls arrive)."""
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def stop(self) -> None:
        """Stop periodic health probes (and the checks of engines that just joined)."""
        for task in list(self._joining):
            task.cancel()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
