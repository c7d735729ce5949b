"""The distributed weight transfer's plan: PlanWeightTransfer asks every engine in rotation its
ranks and lays out the NCCL group (the trainer's ranks first, then each engine's block); a
distributed UpdateWeights is checked against that plan, field by field, before any engine is paused.

Kept apart from the update because the plan outlives one call: it is remembered, with the group
the engines already joined, for the next distributed updates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, Unavailable
from rollout_grpc.server.engines.api import EngineError, TransferGroup, WeightAction
from rollout_grpc.server.engines.pool import EngineHandle
from rollout_grpc.server.rollout.control import describe_failure
from rollout_grpc.server.rollout.weights.engine_steps import EngineSteps
from rollout_grpc.server.rollout.weights.values import (
    DISTRIBUTED,
    DistributedSource,
    TransferPlan,
    check_tensors,
)

log = structlog.get_logger("rollout_grpc.server.rollout.weights")


class TransferPlanner:
    """The last PlanWeightTransfer of this replica and the group its engines joined."""

    def __init__(
        self, steps: EngineSteps, *, deadline_s: float, refuse_if_busy: Callable[[str], None]
    ) -> None:
        self._steps = steps
        self._deadline_s = deadline_s
        #: FAILED_PRECONDITION while a weight update runs on this replica.
        self._refuse_if_busy = refuse_if_busy
        #: The last PlanWeightTransfer, and the group the engines of that plan joined (if any).
        self.plan: TransferPlan | None = None
        self.joined: tuple[TransferGroup, frozenset[str]] | None = None

    async def plan_transfer(self, trainer_ranks: int) -> TransferPlan:
        """Ask every engine in rotation its ranks and lay out the group: the trainer's ranks first,
        then each engine's block. Remembered for the next distributed updates (which join it)."""
        if trainer_ranks < 1:
            raise InvalidArgument("trainer_ranks", f"must be at least 1; got {trainer_ranks}")
        self._refuse_if_busy("plan a weight transfer")
        engines = self._steps.rotation()
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
        self.plan = TransferPlan(world_size=offset, engines=tuple(layout))
        self.joined = None
        log.info("weight_transfer_planned", world_size=offset, trainer_ranks=trainer_ranks, engines=layout)
        return self.plan

    def check(self, source: DistributedSource) -> TransferPlan:
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
        check_tensors(source.tensors)
        plan = self.plan
        if plan is None:
            raise FailedPrecondition(
                "no weight transfer is planned on this replica: call PlanWeightTransfer first"
            )
        if group.world_size != plan.world_size:
            raise FailedPrecondition(
                f"{DISTRIBUTED}.world_size {group.world_size} is not the planned group's {plan.world_size}"
            )
        planned = {url for url, _, _ in plan.engines}
        rotation = {e.url for e in self._steps.rotation()}
        if planned != rotation:
            raise FailedPrecondition(
                "the engines in rotation changed since PlanWeightTransfer (planned "
                f"{sorted(planned)}, now {sorted(rotation)}): plan again and rebuild the group"
            )
        return plan
