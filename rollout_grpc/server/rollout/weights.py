"""Weight updates: new weights reach every engine as one serialised, fleet-wide operation.

`UpdateWeights` (docs/api.md, docs/engines.md "Weight updates") runs, for a checkpoint source:

1. checks before any engine is touched: the path is under an operator's `--weights-path-prefix`
   and the checkpoint's files are sound (`checkpoint.py`: a failed load kills a vLLM 0.32 engine),
   and the new version label does not go backwards (`check_version`);
2. pauses every engine in the caller's mode (`Control.pause`: abort, wait or keep, as `Pause`);
3. loads the checkpoint: on one engine first, then on the others concurrently (`staged`, the
   default), so that a checkpoint the engines refuse costs one engine, not the fleet;
4. labels the engines that loaded with the new version (`/update_weight_version`);
5. takes every engine that was not paused, did not load or was not labelled out of rotation
   (`EnginePool.set_weights_problem`: no new generations; re-admitted only by a later update that
   loads on it), and resumes every engine (`Control.resume`) — kept generations of an engine that
   did not load go on under its old label, which is still true of its weights.

So after the call every engine in rotation serves the new weights under the new label; when some
engine did not, the call fails (UNAVAILABLE) naming each engine and cause, and repeating the same
call (same version, same path) loads only those engines. A second update while one runs, on any
replica or worker sharing the state store, is refused (FAILED_PRECONDITION naming the holder),
never interleaved: before touching any engine an update takes the fleet lease `weights` in the
store (`BufferStore.take_lease`), renews it every third of `--weights-lease-ttl` while it runs and
releases it at its end, so a replica killed mid-update blocks the others for at most that TTL.
The new version must not go backwards from the fleet's order (in the store, `step/versions.py`),
and becomes its newest once an engine took it. When the caller disconnects mid-update, the update runs to
its end (the fleet is resumed on a consistent version) and `weight_update_done` /
`weight_update_failed` says which version the engines ended on.

Colocated training frees and takes back the engines' memory with `release_memory` /
`resume_memory` (ReleaseMemory / ResumeMemory): serialised with the updates (each holds the same
fleet lease while it runs), the engines paused (ABORT) before they free anything and resumed once
every region is back.

Plain Pause / Resume take no lease: they are two calls, possibly to two replicas, and a lease held
between them would outlive a trainer that died in between with nothing to renew or release it.
A Resume(weight_version) still goes through the fleet's version order (never backwards).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, Unavailable
from rollout_grpc.server.engines.api import (
    MEMORY_TAGS,
    ControlAction,
    EngineError,
    MemoryRelease,
    TensorSpec,
    TransferGroup,
    WeightAction,
)
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout.checkpoint import CheckpointSummary, allowed_path, inspect_checkpoint
from rollout_grpc.server.rollout.control import (
    PAUSE_MODES,
    Control,
    ControlFailure,
    FleetResult,
    describe_failure,
)
from rollout_grpc.server.state.api import BufferStore, decimal_backwards
from rollout_grpc.server.state.memory import MemoryStore

__all__ = [
    "CheckpointSource",
    "DistributedSource",
    "EngineOutcome",
    "MemoryRelease",
    "TensorSpec",
    "TransferGroup",
    "TransferPlan",
    "WeightUpdate",
    "WeightUpdateResult",
    "WeightUpdates",
    "check_version",
]

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: The fleet lease every weight update and memory release/resume holds while it runs.
WEIGHTS_LEASE = "weights"
#: Seconds the lease lives after its last renewal (`--weights-lease-ttl`).
DEFAULT_LEASE_TTL_S = 30.0

VERSION_FIELD = "weight_version"
#: Longest accepted version label (it is copied into every sample's weight spans).
MAX_VERSION_CHARS = 256
#: Seconds a checkpoint load may take on one engine (the operator's `--weights-load-timeout`).
DEFAULT_LOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class CheckpointSource:
    """Load the checkpoint directory `path`, which every engine (and this replica) can read."""

    path: str


@dataclass(frozen=True, slots=True)
class DistributedSource:
    """Receive the tensors the trainer broadcasts in `group` (planned by `plan_transfer`)."""

    group: TransferGroup
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The distributed transfer's ranks: the trainer's first, then each engine's block."""

    world_size: int
    #: (engine URL, rank offset, ranks), in rank order.
    engines: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class _Loader:
    """How one update puts weights on an engine: the route named in messages, the call, and whether
    one engine may go first (a broadcast needs every rank at once)."""

    action: WeightAction
    load: Callable[[EngineHandle], Awaitable[None]]
    staged: bool


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """One fleet-wide weight update, in domain terms."""

    source: CheckpointSource | DistributedSource
    #: The label later tokens carry (`Sample.weight_versions`).
    weight_version: str
    #: How in-flight generations are treated while the engines load: abort, wait or keep.
    pause_mode: str
    #: Load on every engine at once instead of on one engine first.
    all_at_once: bool = False


@dataclass(slots=True)
class EngineOutcome:
    """What the update did on one engine: `updated` (loaded and labelled) or `error` says why not."""

    url: str
    updated: bool
    error: str = ""
    #: The engine's load was attempted and failed (its weights may be gone: vLLM 0.32).
    load_failed: bool = False


@dataclass(slots=True)
class WeightUpdateResult:
    """The outcome of an update: per-engine results and the time the fleet was paused."""

    weight_version: str
    #: Distinct labels the engines in rotation carried before the update.
    previous_versions: list[str] = field(default_factory=list)
    engines: list[EngineOutcome] = field(default_factory=list)
    #: Seconds from the first pause to the last resume.
    paused_s: float = 0.0
    #: Seconds the loads took (the slowest engine's, staged loads added up).
    load_s: float = 0.0
    checkpoint: CheckpointSummary | None = None
    #: True when only engines that missed an earlier update to this version were loaded.
    retry: bool = False

    @property
    def failed(self) -> list[EngineOutcome]:
        return [e for e in self.engines if not e.updated]


#: The dtypes a distributed update may name (torch's names, as both engines take them).
TORCH_DTYPES = frozenset(
    {
        "bfloat16",
        "float16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "uint8",
        "int32",
        "int64",
        "bool",
    }
)
DISTRIBUTED = "source.distributed"


def _check_tensors(tensors: Sequence[TensorSpec]) -> None:
    """INVALID_ARGUMENT naming the first tensor field that is wrong."""
    if not tensors:
        raise InvalidArgument(f"{DISTRIBUTED}.tensors", "must list at least one tensor")
    for i, tensor in enumerate(tensors):
        where = f"{DISTRIBUTED}.tensors[{i}]"
        if not tensor.name:
            raise InvalidArgument(f"{where}.name", "must not be empty")
        if tensor.dtype not in TORCH_DTYPES:
            raise InvalidArgument(f"{where}.dtype", f"must be one of {', '.join(sorted(TORCH_DTYPES))}")
        if not tensor.shape or any(d < 1 for d in tensor.shape):
            raise InvalidArgument(f"{where}.shape", f"must list positive sizes; got {list(tensor.shape)[:8]}")


class _StepError(Exception):
    """An engine failed at `action`, one step of a multi-step load (init, then receive)."""

    def __init__(self, action: WeightAction, cause: EngineError) -> None:
        super().__init__(cause.message)
        self.action = action
        self.cause = cause


def _as_int(label: str) -> int | None:
    """The label as a non-negative integer when it is spelled as one ("12", not "v12" or "-1")."""
    return int(label) if label.isascii() and label.isdigit() else None


def _memory_tags(tags: Sequence[str]) -> tuple[str, ...]:
    """The tags, checked against `MEMORY_TAGS` (INVALID_ARGUMENT naming `tags` otherwise)."""
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise InvalidArgument("tags", f"must be among {', '.join(MEMORY_TAGS)}; got {unknown[:4]}")
    return tuple(dict.fromkeys(tags))


def check_version(new: str, current: Sequence[str], used: Sequence[str] = ()) -> None:
    """Refuse a label that goes backwards: FAILED_PRECONDITION naming both labels.

    "Backwards" is defined so that staleness (`Sample.weight_versions`) stays meaningful:
    * the label equals one an engine in rotation carries now, or one this replica set earlier
      (a label names one set of weights; reusing it would mix two under one name);
    * both labels are decimal integers (`"7"`, `"12"`) and the new one is not greater.
    Other labels (`"step-12"`, hashes) only need to be new.
    """
    if not new or len(new) > MAX_VERSION_CHARS or any(ord(c) < 0x20 for c in new):
        raise InvalidArgument(
            VERSION_FIELD, f"must be 1..{MAX_VERSION_CHARS} printable characters; got {new[:64]!r}"
        )
    for label in current:
        if new == label:
            raise FailedPrecondition(f"{VERSION_FIELD} {new!r} is the version the engines already serve")
        old_n, new_n = _as_int(label), _as_int(new)
        if old_n is not None and new_n is not None and new_n <= old_n:
            raise FailedPrecondition(f"{VERSION_FIELD} {new!r} goes backwards from {label!r}")
    if new in used:
        raise FailedPrecondition(f"{VERSION_FIELD} {new!r} was already used by an earlier update")


class WeightUpdates:
    """The UpdateWeights use case over the pool and the fleet control."""

    def __init__(
        self,
        pool: EnginePool,
        control: Control,
        *,
        path_prefixes: Sequence[str] = (),
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        deadline_s: float = 30.0,
        store: BufferStore | None = None,
        holder: str = "this replica",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        #: The fleet's state (lease, version order); one process's memory when not given.
        self._store: BufferStore = store or MemoryStore()
        #: How the lease names this process to the others ("replica … pid …", "worker 1 …").
        self._holder = holder
        self._lease_ttl_s = lease_ttl_s
        #: Operations that took the lease here (each token is its own).
        self._operations = 0
        self._pool = pool
        self._control = control
        self._prefixes = tuple(path_prefixes)
        self._load_timeout_s = load_timeout_s
        self._deadline_s = deadline_s
        #: The version being set by the update in progress, None when none runs.
        self._running: str | None = None
        self._task: asyncio.Task[WeightUpdateResult] | None = None
        #: Every label this replica set, and the last (version, path) for retries.
        self._used: list[str] = []
        self._last: tuple[str, str] | None = None
        #: Memory regions the engines freed (ReleaseMemory) and have not taken back yet.
        self._asleep: set[str] = set()
        self._memory_busy = False
        #: The last PlanWeightTransfer, and the group the engines of that plan joined (if any).
        self._plan: TransferPlan | None = None
        self._joined: tuple[TransferGroup, frozenset[str]] | None = None

    @property
    def running(self) -> str | None:
        """The version an update in progress is setting."""
        return self._running

    async def update(self, update: WeightUpdate) -> WeightUpdateResult:
        """Run one update (see the module docstring); raises the domain errors described there."""
        if update.pause_mode not in PAUSE_MODES:
            raise InvalidArgument("pause_mode", f"must be ABORT, WAIT or KEEP; got {update.pause_mode!r}")
        if isinstance(update.source, CheckpointSource):
            path = allowed_path(update.source.path, self._prefixes)
        else:
            plan = self._check_distributed(update.source)
            path = f"distributed {update.source.group.master_address}:{update.source.group.master_port}"
        if self._running is not None:
            raise FailedPrecondition(
                f"a weight update to {self._running!r} is in progress on this replica; updates are "
                "serialised: retry when it has finished"
            )
        self._refuse_if_busy("update weights")
        self._running = update.weight_version
        try:
            token = await self._take_lease(f"update weights to {update.weight_version!r}")
        except BaseException:
            self._running = None
            raise
        task = asyncio.ensure_future(
            self._leased(
                token,
                self._run(update, path)
                if isinstance(update.source, CheckpointSource)
                else self._run_distributed(update, plan),
            )
        )
        self._task = task
        task.add_done_callback(self._finished)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                log.warning(
                    "weight_update_caller_gone",
                    weight_version=update.weight_version,
                    note="the update goes on to its end; weight_update_done/failed says where the fleet is",
                )
            raise

    # ----------------------------------------------------------------------------- the fleet lease

    async def _take_lease(self, what: str) -> str:
        """Take the fleet lease for one operation (its token names this replica or worker and the
        operation), or FAILED_PRECONDITION naming the holder (UNAVAILABLE naming the store when it
        does not answer). Each operation's token is its own, so two operations of one process
        exclude each other too."""
        self._operations += 1
        token = f"{self._holder} ({what}, #{self._operations})"
        holder = await self._store.take_lease(WEIGHTS_LEASE, token, self._lease_ttl_s)
        if holder:
            raise FailedPrecondition(
                f"cannot {what}: a weight update or memory release holds the fleet lease on {holder}; "
                "updates are serialised fleet-wide: retry when it has finished (a holder that died "
                f"lets go within {self._lease_ttl_s:g} s)"
            )
        return token

    async def _leased(self, token: str, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` holding the fleet lease `token` (already taken by `_take_lease`)."""
        async with self._holding(token):
            return await work

    @contextlib.asynccontextmanager
    async def _holding(self, token: str) -> AsyncIterator[None]:
        """The lease taken: renewed every third of its TTL meanwhile, released at the end whatever
        the outcome (a release that fails is logged: the lease expires by itself)."""
        renewer = asyncio.ensure_future(self._renew_lease(token))
        try:
            yield
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            try:
                await self._store.release_lease(WEIGHTS_LEASE, token)
            except Exception as exc:
                log.error("weights_lease_release_failed", holder=token, error=str(exc))

    async def _renew_lease(self, token: str) -> None:
        while True:
            await asyncio.sleep(self._lease_ttl_s / 3)
            try:
                held = await self._store.renew_lease(WEIGHTS_LEASE, token, self._lease_ttl_s)
            except Exception as exc:
                log.error("weights_lease_renew_failed", holder=token, error=str(exc))
                continue
            if not held:
                log.error(
                    "weights_lease_lost",
                    holder=token,
                    note="the lease expired while this update ran (the store was unreachable for "
                    "longer than --weights-lease-ttl): another update may start meanwhile",
                )

    @contextlib.asynccontextmanager
    async def _lease(self, what: str) -> AsyncIterator[None]:
        """The fleet lease around one short operation (memory release / resume)."""
        token = await self._take_lease(what)
        async with self._holding(token):
            yield

    async def _check_fleet_order(self, version: str) -> list[str]:
        """The fleet's version order, after refusing `version` when it goes backwards from it."""
        order = await self._store.version_order()
        if order and version != order[-1] and (version in order or decimal_backwards(version, order[-1])):
            raise FailedPrecondition(
                f"{VERSION_FIELD} {version!r} goes backwards: the fleet's newest is {order[-1]!r}"
            )
        return order

    async def _advance_fleet_order(self, version: str) -> None:
        """`version` is the fleet's newest now (an engine took it). The engines already carry it, so
        a store that does not answer now is logged, not raised: failing the call would send the
        trainer to repeat an update that happened; steps see the label once a Resume records it."""
        try:
            ok, order = await self._store.advance_version(version)
        except Exception as exc:
            log.error("weight_version_order_not_recorded", weight_version=version, error=str(exc))
            return
        if not ok:  # only a Resume with a newer label, racing this update, can do this
            log.error("weight_version_order_refused", weight_version=version, newest=order[-1])

    def _finished(self, task: asyncio.Task[WeightUpdateResult]) -> None:
        self._running = None
        self._task = None
        if not task.cancelled():
            task.exception()  # retrieved: the caller (if still there) got it; the log line has it

    async def close(self) -> None:
        """Let an update in progress finish (its resume), bounded by the load timeout, at shutdown."""
        task = self._task
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), self._load_timeout_s + 2 * self._deadline_s)
            except BaseException:  # its outcome is logged by the task itself
                task.cancel()

    # ----------------------------------------------------------------------------- distributed transfer

    async def plan_transfer(self, trainer_ranks: int) -> TransferPlan:
        """Ask every engine in rotation its ranks and lay out the group: the trainer's ranks first,
        then each engine's block. Remembered for the next distributed updates (which join it)."""
        if trainer_ranks < 1:
            raise InvalidArgument("trainer_ranks", f"must be at least 1; got {trainer_ranks}")
        self._refuse_if_busy("plan a weight transfer")
        engines = self._rotation()
        if not engines:
            raise Unavailable("no engine is in rotation to plan a weight transfer for")

        async def ask(engine: EngineHandle) -> int | str:
            route = engine.client.weight_route(WeightAction.TRANSFER_RANKS)
            try:
                async with asyncio.timeout(self._deadline_s):
                    return await engine.client.transfer_ranks()
            except TimeoutError:
                return f"{route}: no answer within {self._deadline_s:g} s"
            except EngineError as exc:
                return describe_failure(exc, route, engine.client.missing_route_hint)[1]

        answers = await asyncio.gather(*(ask(e) for e in engines))
        errors = [f"{e.url}: {a}" for e, a in zip(engines, answers, strict=True) if isinstance(a, str)]
        if errors:
            raise Unavailable("cannot plan the weight transfer: " + "; ".join(errors))
        layout: list[tuple[str, int, int]] = []
        offset = trainer_ranks
        for engine, ranks in zip(engines, answers, strict=True):
            assert isinstance(ranks, int)
            layout.append((engine.url, offset, ranks))
            offset += ranks
        self._plan = TransferPlan(world_size=offset, engines=tuple(layout))
        self._joined = None
        log.info("weight_transfer_planned", world_size=offset, trainer_ranks=trainer_ranks, engines=layout)
        return self._plan

    def _check_distributed(self, source: DistributedSource) -> TransferPlan:
        """The plan a distributed update runs on, after checking its fields (named) against it."""
        group = source.group
        if group.backend != "nccl":
            raise InvalidArgument(f"{DISTRIBUTED}.backend", f"must be nccl; got {group.backend[:32]!r}")
        if not group.master_address:
            raise InvalidArgument(f"{DISTRIBUTED}.master_address", "must be set")
        if not 1 <= group.master_port <= 65535:
            raise InvalidArgument(f"{DISTRIBUTED}.master_port", f"must be 1-65535; got {group.master_port}")
        if not group.group_name:
            raise InvalidArgument(f"{DISTRIBUTED}.group_name", "must not be empty")
        _check_tensors(source.tensors)
        plan = self._plan
        if plan is None:
            raise FailedPrecondition(
                "no weight transfer is planned on this replica: call PlanWeightTransfer first"
            )
        if group.world_size != plan.world_size:
            raise FailedPrecondition(
                f"{DISTRIBUTED}.world_size {group.world_size} is not the planned group's {plan.world_size}"
            )
        planned = {url for url, _, _ in plan.engines}
        rotation = {e.url for e in self._rotation()}
        if planned != rotation:
            raise FailedPrecondition(
                "the engines in rotation changed since PlanWeightTransfer (planned "
                f"{sorted(planned)}, now {sorted(rotation)}): plan again and rebuild the group"
            )
        return plan

    async def _run_distributed(self, update: WeightUpdate, plan: TransferPlan) -> WeightUpdateResult:
        source = update.source
        assert isinstance(source, DistributedSource)
        version = update.weight_version
        loop = asyncio.get_running_loop()
        try:
            labels = await self._labels()
            in_rotation = sorted({labels.get(e.url, e.weight_version) for e in self._rotation()} - {""})
            check_version(version, in_rotation, self._used)
            await self._check_fleet_order(version)
            offsets = {url: offset for url, offset, _ in plan.engines}
            targets = [e for e in self._pool.engines if e.url in offsets]
            result = WeightUpdateResult(version, in_rotation)
            started = loop.time()
            try:
                paused = await self._control.pause(update.pause_mode)
            except Exception as exc:
                raise Unavailable(f"weight update to {version!r} not started: {exc}") from exc
            joined = (
                self._joined[1]
                if self._joined is not None and self._joined[0] == source.group
                else frozenset()
            )
            newly: set[str] = set()

            async def load(engine: EngineHandle) -> None:
                if engine.url not in joined:
                    try:
                        await engine.client.init_transfer(
                            source.group, offsets[engine.url], self._load_timeout_s
                        )
                    except EngineError as exc:
                        raise _StepError(WeightAction.INIT_TRANSFER, exc) from exc
                    newly.add(engine.url)
                await engine.client.receive_weights(source.group, source.tensors, self._load_timeout_s)

            try:
                await self._load_and_label(
                    update, _Loader(WeightAction.RECEIVE_WEIGHTS, load, staged=False), targets, paused, result
                )
            finally:
                self._joined = (source.group, frozenset(joined | newly))
                resumed = await self._resume(result)
                result.paused_s = loop.time() - started
            if any(e.updated for e in result.engines):
                self._used.append(version)
                await self._advance_fleet_order(version)
        except BaseException as exc:
            log.error(
                "weight_update_failed",
                weight_version=version,
                source="distributed",
                error=str(exc) or repr(exc),
            )
            raise
        self._report(result, resumed, "Fix the engines that missed it, plan again and repeat the update")
        return result

    # ----------------------------------------------------------------------------- colocated memory

    def _refuse_if_busy(self, what: str) -> None:
        if self._running is not None:
            raise FailedPrecondition(
                f"cannot {what} while a weight update to {self._running!r} runs on this replica"
            )

    async def release_memory(self, release: MemoryRelease) -> FleetResult:
        """Pause every engine (ABORT) and free its memory; fails when no engine freed any."""
        if release.level not in (0, 1, 2):
            raise InvalidArgument("level", f"must be 0, 1 or 2 (vLLM's sleep levels); got {release.level}")
        tags = _memory_tags(release.tags)
        self._refuse_if_busy("release memory")
        async with self._lease("release memory"):
            return await self._release_memory(release, tags)

    async def _release_memory(self, release: MemoryRelease, tags: tuple[str, ...]) -> FleetResult:
        paused = await self._control.pause("abort")
        engines = [e for e in self._pool.engines if e.url in paused.ok]
        result = await self._each(
            engines, WeightAction.RELEASE_MEMORY, lambda e: e.client.release_memory(release)
        )
        result.extend(paused)
        self._asleep.update(tags or MEMORY_TAGS)
        log.info(
            "memory_released",
            level=release.level,
            tags=list(tags),
            released=len(result.ok),
            errors=len(result.errors),
        )
        result.raise_if_none_ok("release memory")
        return result

    async def resume_memory(self, tags: tuple[str, ...]) -> tuple[FleetResult, bool]:
        """Take the regions `tags` (all when empty) back on every engine; resume generation once
        every region is back. (result, whether the engines were resumed)."""
        tags = _memory_tags(tags)
        self._refuse_if_busy("resume memory")
        async with self._lease("resume memory"):
            return await self._resume_memory(tags)

    async def _resume_memory(self, tags: tuple[str, ...]) -> tuple[FleetResult, bool]:
        result = await self._each(
            self._pool.engines, WeightAction.RESUME_MEMORY, lambda e: e.client.resume_memory(tags)
        )
        self._asleep.difference_update(tags or MEMORY_TAGS)
        generating = not self._asleep
        if generating:
            resumed = await self._control.resume(None)
            result.extend(resumed, "resume: ")
        log.info(
            "memory_resumed",
            tags=list(tags),
            resumed=len(result.ok),
            errors=len(result.errors),
            generating=generating,
        )
        result.raise_if_none_ok("take memory back")
        return result, generating

    async def _each(
        self,
        engines: Sequence[EngineHandle],
        action: WeightAction,
        call: Callable[[EngineHandle], Awaitable[None]],
    ) -> FleetResult:
        """`call` on every engine concurrently, each within the control deadline."""
        result = FleetResult()

        async def one(engine: EngineHandle) -> None:
            route = engine.client.weight_route(action)
            try:
                async with asyncio.timeout(self._deadline_s):
                    await call(engine)
            except TimeoutError:
                result.fail(
                    engine.url, ControlFailure.TIMEOUT, f"{route}: no answer within {self._deadline_s:g} s"
                )
                return
            except EngineError as exc:
                kind, message = describe_failure(exc, route, engine.client.missing_route_hint)
                result.fail(engine.url, kind, message)
                return
            result.ok.append(engine.url)

        await asyncio.gather(*(one(e) for e in engines if e.healthy))
        return result

    # ----------------------------------------------------------------------------- the steps

    async def _run(self, update: WeightUpdate, path: str) -> WeightUpdateResult:
        version = update.weight_version
        loop = asyncio.get_running_loop()
        try:
            summary = await asyncio.to_thread(inspect_checkpoint, path, self._prefixes)
            labels = await self._labels()
            in_rotation = sorted({labels.get(e.url, e.weight_version) for e in self._rotation()} - {""})
            retry = self._last == (version, path)
            if retry:
                targets = [e for e in self._pool.engines if e.weights_problem or labels.get(e.url) != version]
                if not targets:
                    return WeightUpdateResult(version, in_rotation, checkpoint=summary, retry=True)
            else:
                check_version(version, in_rotation, self._used)
                await self._check_fleet_order(version)
                targets = self._pool.engines
            result = WeightUpdateResult(version, in_rotation, checkpoint=summary, retry=retry)
            started = loop.time()
            try:
                paused = await self._control.pause(update.pause_mode)
            except Exception as exc:
                raise Unavailable(f"weight update to {version!r} not started: {exc}") from exc
            loader = _Loader(
                WeightAction.LOAD_CHECKPOINT,
                lambda e: e.client.load_checkpoint(path, timeout=self._load_timeout_s),
                staged=not update.all_at_once,
            )
            try:
                await self._load_and_label(update, loader, targets, paused, result)
            finally:
                resumed = await self._resume(result)
                result.paused_s = loop.time() - started
            if any(e.updated for e in result.engines):  # a version no engine took stays free
                self._used.append(version)
                self._last = (version, path)
                await self._advance_fleet_order(version)
        except BaseException as exc:
            log.error("weight_update_failed", weight_version=version, path=path, error=str(exc) or repr(exc))
            raise
        self._report(result, resumed)
        return result

    async def _labels(self) -> dict[str, str]:
        """Each healthy engine's current label (asked now: another client may have relabelled)."""

        async def ask(engine: EngineHandle) -> tuple[str, str]:
            try:
                engine.weight_version = await asyncio.wait_for(
                    engine.client.weight_version(), self._deadline_s
                )
            except (EngineError, TimeoutError) as exc:
                log.warning("weight_version_unknown", engine=engine.url, error=str(exc))
            return engine.url, engine.weight_version

        return dict(await asyncio.gather(*(ask(e) for e in self._pool.engines if e.healthy)))

    def _rotation(self) -> list[EngineHandle]:
        return [e for e in self._pool.engines if e.usable]

    async def _load_and_label(
        self,
        update: WeightUpdate,
        loader: _Loader,
        targets: Sequence[EngineHandle],
        paused: FleetResult,
        result: WeightUpdateResult,
    ) -> None:
        """Load on the paused targets (one first when `loader.staged`), then label those that loaded."""
        pause_errors = dict(paused.errors)
        outcomes = {e.url: EngineOutcome(e.url, updated=False) for e in targets}
        result.engines = list(outcomes.values())
        ready = [e for e in targets if e.url in paused.ok]
        for engine in targets:
            if engine.url in pause_errors:
                outcomes[engine.url].error = f"not paused, so not loaded: {pause_errors[engine.url]}"
        loop = asyncio.get_running_loop()
        begin = loop.time()
        first, rest = (ready[:1], ready[1:]) if loader.staged else (ready, [])
        loaded = await self._load_all(first, loader, outcomes)
        if rest and loaded:
            loaded += await self._load_all(rest, loader, outcomes)
        elif rest:
            for engine in rest:
                outcomes[engine.url].error = "not loaded: the first engine's load failed (staged update)"
        result.load_s = loop.time() - begin
        await self._label(loaded, update.weight_version, outcomes)

    async def _load_all(
        self, engines: Sequence[EngineHandle], loader: _Loader, outcomes: dict[str, EngineOutcome]
    ) -> list[EngineHandle]:
        async def one(engine: EngineHandle) -> bool:
            route = engine.client.weight_route(loader.action)
            try:
                async with asyncio.timeout(self._load_timeout_s):
                    await loader.load(engine)
            except TimeoutError:
                outcomes[engine.url].error = f"{route}: no answer within {self._load_timeout_s:g} s"
                outcomes[engine.url].load_failed = True
                return False
            except _StepError as exc:  # joining the group failed: the weights were not touched
                _, message = describe_failure(
                    exc.cause, engine.client.weight_route(exc.action), engine.client.missing_route_hint
                )
                outcomes[engine.url].error = message
                return False
            except EngineError as exc:
                _, message = describe_failure(exc, route, engine.client.missing_route_hint)
                outcomes[engine.url].error = message
                outcomes[engine.url].load_failed = True
                return False
            return True

        done = await asyncio.gather(*(one(e) for e in engines))
        return [e for e, ok in zip(engines, done, strict=True) if ok]

    async def _label(
        self, engines: Sequence[EngineHandle], version: str, outcomes: dict[str, EngineOutcome]
    ) -> None:
        async def one(engine: EngineHandle) -> None:
            try:
                async with asyncio.timeout(self._deadline_s):
                    await engine.client.update_weight_version(version)
            except (EngineError, TimeoutError) as exc:
                route = engine.client.control_route(ControlAction.UPDATE_WEIGHT_VERSION)
                detail = (
                    exc.message
                    if isinstance(exc, EngineError)
                    else f"no answer within {self._deadline_s:g} s"
                )
                outcomes[engine.url].error = f"loaded, but the version was not set ({route}: {detail})"
                return
            engine.weight_version = version
            outcomes[engine.url].updated = True

        await asyncio.gather(*(one(e) for e in engines))

    async def _resume(self, result: WeightUpdateResult) -> FleetResult | None:
        """Out of rotation what did not update, back in what did; then resume every engine.

        When no engine updated, the fleet stays on its previous version: only the engines whose
        load failed (their weights may be gone) leave the rotation; the others keep serving.
        """
        any_updated = any(o.updated for o in result.engines)
        rotation: dict[str, str] = {}
        for outcome in result.engines:
            engine = self._pool.get(outcome.url)
            if engine is None:
                continue
            if outcome.updated:
                rotation[engine.url] = ""
            elif any_updated or outcome.load_failed:
                rotation[engine.url] = f"weight update to {result.weight_version!r} failed: {outcome.error}"
            if engine.url in rotation:
                self._pool.set_weights_problem(engine, rotation[engine.url])
        updated = [o.url for o in result.engines if o.updated]
        try:  # the other workers of this replica route the same way and know the new labels
            await self._control.weights_updated(result.weight_version, updated, rotation)
        except Exception as exc:
            log.error("weight_update_sync_failed", weight_version=result.weight_version, error=str(exc))
        if self._asleep:  # colocated: generation resumes when ResumeMemory brought everything back
            log.info("weight_update_resume_deferred", asleep=sorted(self._asleep))
            return FleetResult()
        try:
            return await self._control.resume(None)
        except Exception as exc:  # reported with the update's outcome; never hides the load's error
            log.error("weight_update_resume_failed", weight_version=result.weight_version, error=str(exc))
            return None

    def _report(
        self,
        result: WeightUpdateResult,
        resumed: FleetResult | None,
        hint: str = "Repeat the same call to load on the engines that missed it",
    ) -> None:
        failed = result.failed
        log.info(
            "weight_update_done" if not failed else "weight_update_failed",
            weight_version=result.weight_version,
            previous_versions=result.previous_versions,
            updated=[e.url for e in result.engines if e.updated],
            not_updated={e.url: e.error for e in failed},
            out_of_rotation=sorted(e.url for e in self._pool.engines if e.weights_problem),
            resumed=len(resumed.ok) if resumed is not None else 0,
            resume_errors=len(resumed.errors) if resumed is not None else -1,
            paused_s=round(result.paused_s, 3),
            load_s=round(result.load_s, 3),
            retry=result.retry,
        )
        if failed:
            causes = "; ".join(f"{e.url}: {e.error}" for e in failed)
            updated = len(result.engines) - len(failed)
            if updated:
                state = f"{updated} engine(s) serve {result.weight_version!r}, the others are out of rotation"
            else:
                previous = ", ".join(repr(v) for v in result.previous_versions) or "their previous weights"
                state = f"no engine serves it; the engines in rotation still serve {previous}"
            raise Unavailable(
                f"weight update to {result.weight_version!r} failed on {len(failed)} engine(s) ({causes}); "
                f"{state}. {hint}"
            )
