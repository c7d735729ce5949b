"""The rollout step's parts without a server: version order, filters, reward parsing, math-verify
on real answer strings, the owner abort window, and the up-front checks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument
from rollout_grpc.server.domain.identity import ANONYMOUS, Caller, Role, reset_caller, set_caller
from rollout_grpc.server.domain.model import GenerateOptions, Sample, SamplingParams, Status
from rollout_grpc.server.engines.api import EngineCall, EngineEvent
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.rewards.api import FilterGroup, RewardFailed, RewardRequest, RewardResult
from rollout_grpc.server.rewards.processes import ProcessLimits
from rollout_grpc.server.rewards.registry import rule_processes
from rollout_grpc.server.rewards.remote import read_reward
from rollout_grpc.server.rewards.rules import ExactMatchReward, MathReward, exact_answer, math_value
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.inflight import InFlightRegistry
from rollout_grpc.server.rollout.step import filters
from rollout_grpc.server.rollout.step.buffer import StepBuffers
from rollout_grpc.server.rollout.step.events import GroupEnded, Progress, Summary
from rollout_grpc.server.rollout.step.loop import Step
from rollout_grpc.server.rollout.step.runner import StepRunner
from rollout_grpc.server.rollout.step.spec import FilterKind, Outcome, PromptGroup, StepSpec, check
from rollout_grpc.server.rollout.step.state import GroupDone, GroupRun
from rollout_grpc.server.rollout.step.versions import FleetVersions, VersionOrder
from rollout_grpc.server.state.memory import MemoryStore
from tests.support.fake_engine import FakeEngine, final, tokens


def make(engine: FakeEngine) -> Rollout:
    """A Rollout over one scripted engine."""
    pool = EnginePool([engine.url], {engine.url: engine}.__getitem__)
    return Rollout(pool, Admission(4, 4), InFlightRegistry())


def test_numeric_versions_order_by_value_others_by_resume_order() -> None:
    order = VersionOrder()
    assert order.lag("anything") == 0, "nothing known: no lag"
    for label in ("3", "4", "7"):
        order.advance(label)
    assert order.lag("7") == 0 and order.lag("4") == 3 and order.lag("3") == 4
    named = VersionOrder()
    for label in ("step-a", "step-b", "step-c"):
        named.advance(label)
    assert named.lag("step-c") == 0 and named.lag("step-a") == 2
    assert named.lag("default") == 3, "a label never set here is older than every set one"


async def test_the_version_order_is_the_stores_read_once_per_refresh() -> None:
    store = MemoryStore()
    on_a, on_b = FleetVersions(store), FleetVersions(store)  # two replicas sharing one store
    await on_a.advance("v1")
    await on_a.advance("v2")
    assert on_a.lag("v1") == 1
    assert on_b.lag("v1") == 0, "a copy is read at a step's start, not per sample"
    await on_b.refresh()
    assert on_b.newest == "v2" and on_b.lag("v1") == 1
    with pytest.raises(FailedPrecondition, match="'v1' goes backwards: the fleet's newest is 'v2'"):
        await on_b.advance("v1")
    assert await store.version_order() == ["v1", "v2"]
    with pytest.raises(InvalidArgument, match="weight_version"):
        await on_b.advance("v" * 257)
    assert await store.version_order() == ["v1", "v2"]


def test_the_nonzero_std_filter_keeps_only_groups_whose_rewards_vary() -> None:
    assert filters.drop_reason(FilterKind.REWARD_NONZERO_STD, [0.0, 1.0], 0.0) is None
    reason = filters.drop_reason(FilterKind.REWARD_NONZERO_STD, [1.0, 1.0, 1.0], 0.0)
    assert reason is not None and "reward std 0" in reason
    assert filters.drop_reason(FilterKind.REWARD_NONZERO_STD, [0.0, 0.1], 0.1) is not None
    assert filters.drop_reason(FilterKind.KEEP_ALL, [1.0, 1.0], 0.0) is None


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (0.75, RewardResult(0.75)),
        (2, RewardResult(2.0)),
        ({"reward": 1, "acc": True}, RewardResult(1.0, {"reward": 1, "acc": True})),
    ],
)
def test_a_remote_answer_is_a_number_or_an_object_with_the_key(
    answer: object, expected: RewardResult
) -> None:
    assert read_reward(answer, "reward") == expected


@pytest.mark.parametrize(
    "answer", [True, "1.0", None, [1.0], {"score": 1.0}, {"reward": "high"}, float("nan")]
)
def test_anything_else_is_an_explicit_failure_never_zero(answer: object) -> None:
    outcome = read_reward(answer, "reward")
    assert isinstance(outcome, RewardFailed) and outcome.reason


@pytest.mark.parametrize(
    ("label", "response", "reward"),
    [
        ("\\frac{1}{2}", "Halving it gives the answer $\\boxed{0.5}$.", 1.0),
        ("0.5", "So the result is \\boxed{\\frac{1}{2}}", 1.0),
        ("42", "Adding the two gives \\boxed{42}.", 1.0),
        ("42", "Adding the two gives \\boxed{41}.", 0.0),
        ("x^2+2x+1", "Expanding, we get $\\boxed{(x+1)^2}$", 1.0),
        ("3", "I do not know.", 0.0),
        # Answer strings as models write them (GSM8K's "####", a think block, LaTeX labels).
        ("18", "She sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18 a day.\n#### 18", 1.0),
        ("5", "<think>2 + 3 is 5</think> The final answer is \\boxed{5}", 1.0),
        ("5", "The final answer is \\boxed{6}, not 5", 0.0),
        ("\\frac{14}{3}", "So $x = \\dfrac{14}{3}$, i.e. \\boxed{\\dfrac{14}{3}}", 1.0),
        ("2\\sqrt{2}", "Simplifying gives $\\boxed{\\sqrt{8}}$.", 1.0),
        ("2\\sqrt{2}", "so \\boxed{2\\sqrt{2}}", 1.0),
        ("2\\sqrt{2}", "so \\boxed{2}", 0.0),
        ("3\\pi", "The area is \\boxed{3\\pi}.", 1.0),
        ("10\\%", "The rate is \\boxed{10\\%}.", 1.0),
        ("(3, -1)", "The intersection point is \\boxed{(3,-1)}.", 1.0),
    ],
)
def test_math_verify_checks_answer_equivalence(label: str, response: str, reward: float) -> None:
    assert math_value(label, response) == reward


async def test_rule_rewards_run_in_a_child_process() -> None:
    rules = rule_processes()
    try:
        outcome = await MathReward(rules).score(
            RewardRequest(prompt="", response="\\boxed{0.5}", label="1/2")
        )
        assert outcome == RewardResult(1.0)
        assert rules.started == 1  # the same child serves the next call
        outcome = await MathReward(rules).score(RewardRequest(prompt="", response="\\boxed{1}", label=""))
        assert isinstance(outcome, RewardFailed) and "label" in outcome.reason
        reward = ExactMatchReward(rules)
        assert exact_answer("first \\boxed{1} then \\boxed{2} ") == "2"
        assert await reward.score(RewardRequest("", " Paris ", "Paris")) == RewardResult(1.0)
        assert await reward.score(RewardRequest("", "so \\boxed{Rome}", "Paris")) == RewardResult(0.0)
        assert rules.started == 1
    finally:
        await rules.close()
    assert rules.started == 0
    assert isinstance(await ExactMatchReward(rules).score(RewardRequest("", "a", "a")), RewardFailed)


async def test_a_rule_reward_over_its_time_limit_is_killed_and_replaced() -> None:
    """The issue's freeze: `9^{9^{9^{9}}}` computes for minutes holding Python's lock."""
    rules = rule_processes(ProcessLimits(processes=1, timeout_s=1.0))
    try:
        huge = RewardRequest(prompt="", response="\\boxed{5}", label="9^{9^{9^{9}}}")
        outcome = await MathReward(rules).score(huge)
        assert isinstance(outcome, RewardFailed)
        assert "time limit of 1 s" in outcome.reason and "--rule-reward-timeout-s" in outcome.reason
        assert rules.killed == 1
        # A fresh child answers the next call.
        ok = await MathReward(rules).score(RewardRequest(prompt="", response="\\boxed{2}", label="2"))
        assert ok == RewardResult(1.0)
    finally:
        await rules.close()


def allocate(label: str, response: str) -> float:
    """A rule that allocates `label` MiB (runs in the child)."""
    return float(len(bytearray(int(label) << 20)))


async def test_a_rule_reward_over_its_memory_limit_fails_naming_it() -> None:
    rules = rule_processes(ProcessLimits(processes=1, timeout_s=60.0, memory_mb=400))
    try:
        outcome = await rules.run(allocate, "600", "")
        assert isinstance(outcome, RewardFailed), outcome
        assert "memory limit of 400 MiB" in outcome.reason and "--rule-reward-memory-mb" in outcome.reason
        assert await rules.run(allocate, "10", "") == RewardResult(float(10 << 20))  # a fresh child
    finally:
        await rules.close()


async def test_a_generate_of_the_caller_during_its_abort_window_ends_aborted_without_an_engine_call() -> None:
    engine = FakeEngine("a", [[tokens(10), final()]])
    rollout = make(engine)
    token = set_caller(Caller(identity="trainer-1", role=Role.TRAINER))
    try:
        rollout.begin_owner_abort("trainer-1")
        results = [
            e
            async for e in rollout.generate(
                Sample(prompt_ids=(1, 2)), SamplingParams(), GenerateOptions(), "x"
            )
        ]
        assert isinstance(results[-1], Sample) and results[-1].status is Status.ABORTED
        assert not engine.calls
        rollout.begin_owner_abort("someone-else")
        rollout.end_owner_abort("trainer-1")
        results = [
            e
            async for e in rollout.generate(
                Sample(prompt_ids=(1, 2)), SamplingParams(), GenerateOptions(), "y"
            )
        ]
        assert isinstance(results[-1], Sample) and results[-1].status is not Status.ABORTED
        assert len(engine.calls) == 1, "another caller's abort does not touch this caller"
    finally:
        reset_caller(token)


def test_watchers_hear_an_abort_of_their_owner_only() -> None:
    rollout = make(FakeEngine("a", []))
    heard: list[str] = []
    unwatch = rollout.watch_owner_aborts("t", lambda: heard.append("t"))
    rollout.begin_owner_abort("other")
    rollout.begin_owner_abort("t")
    unwatch()
    rollout.begin_owner_abort("t")
    assert heard == ["t"]


def spec(**kw: object) -> StepSpec:
    base: dict[str, object] = {
        "step_id": "s",
        "groups": [PromptGroup(0, Sample(prompt_ids=(1, 2)))],
        "n_samples_per_prompt": 2,
        "params": SamplingParams(),
        "options": GenerateOptions(),
    }
    return StepSpec(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"groups": []}, "groups"),
        (
            {"groups": [PromptGroup(0, Sample(prompt_ids=(1,))), PromptGroup(0, Sample(prompt_ids=(2,)))]},
            "groups[1].group_index",
        ),
        ({"groups": [PromptGroup(0, Sample())]}, "groups[0].prompt"),
        ({"max_groups_in_flight": -1}, "max_groups_in_flight"),
        ({"epsilon": -0.1}, "filter.epsilon"),
        ({"params": SamplingParams(seed=2**63 - 1)}, "sampling_params.seed"),
    ],
)
def test_bad_steps_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check(spec(**kw), buffered=0)
    assert err.value.field == field


def test_buffered_groups_count_toward_the_supply() -> None:
    check(spec(groups=[], target_groups=2, continue_buffered=True), buffered=2)
    with pytest.raises(InvalidArgument):
        check(spec(groups=[], target_groups=2, continue_buffered=False), buffered=2)


class _DropGroupZero:
    """A custom filter (the GroupFilter protocol, as a plugin implements it) dropping group 0."""

    async def verdict(self, group: FilterGroup) -> str | None:
        return "group 0 is never kept" if group.group_index == 0 else None

    async def close(self) -> None:
        return None


async def _no_abort(request_ids: list[str]) -> object:
    return None


def _wave_step(runner_store: MemoryStore | None = None) -> tuple[StepRunner, Step]:
    """A step of three groups of 8 one-token samples over a scripted engine, target 1 (slime's
    rule: one group per batch), whose custom filter drops group 0."""
    n = 8
    engine = FakeEngine("a", [[tokens(10, 11), final(n=2)]])
    pool = EnginePool([engine.url], {engine.url: engine}.__getitem__)
    rollout = Rollout(pool, Admission(64, 64), InFlightRegistry())
    runner = StepRunner(rollout, _no_abort, lambda config: None, buffers=StepBuffers(runner_store))
    groups = [PromptGroup(g, Sample(prompt_ids=(1, 2, g)), prompt_index=g * n) for g in range(3)]
    spec = StepSpec("wave", groups, n, SamplingParams(max_new_tokens=2), GenerateOptions(), target_groups=1)
    step = Step(runner, spec, ANONYMOUS.identity, None, 0, None, None, [])
    step.custom_filter = _DropGroupZero()
    return runner, step


async def _first_batch_ended(step: Step) -> None:
    """Wait until group 0's coordinator has queued every sample's event and the group's (it does
    so before it returns) while the caller reads nothing."""
    await asyncio.wait([run.task for run in step.active.values() if run.task is not None])
    assert step.events_q.qsize() == step.spec.n_samples_per_prompt + 1


async def test_a_drop_starts_the_next_batch_before_the_earlier_samples_progress_is_sent() -> None:
    """A wave of samples ends at once: the drop behind them is accounted, and slime's rule starts
    the next batch, before the step sends anything for those samples. It used to send one progress
    message per sample first, each a wait on the caller's stream, and the next batch waited for
    all of them (bench/step_trace.py: the dropped group accounted 0.3-0.6 s after it was judged).
    One progress message now carries them."""
    runner, step = _wave_step()
    events = step.events()
    try:
        first = await anext(events)
        assert isinstance(first, Progress) and first.in_flight == 1, "slime's rule: one batch of 1 group"
        await _first_batch_ended(step)
        second = await anext(events)
        assert step.counters.submitted == 2, "the drop started the next batch before anything was sent"
        assert isinstance(second, GroupEnded) and second.outcome is Outcome.FILTERED, second
        third = await anext(events)
        assert isinstance(third, Progress) and third.generated == 8 and third.dropped == {"filter": 1}
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # an async generator (Step.events)
        await runner.drained()


class _HoldLog(MemoryStore):
    """The embedded store, noting each set of groups a lease names held."""

    def __init__(self) -> None:
        super().__init__()
        self.holds: list[set[int]] = []

    async def hold_groups(self, owner: str, lease: str, indexes: Sequence[int]) -> None:
        self.holds.append(set(indexes))
        await super().hold_groups(owner, lease, indexes)


async def test_a_group_stays_held_in_the_store_until_it_is_sent_though_the_next_batch_started() -> None:
    """The next batch starts before the ended group is sent: the store names both held (a process
    dying then has the ended group reported lost, not silently gone), and the ended one is let go
    once it was sent."""
    store = _HoldLog()
    runner, step = _wave_step(store)
    step.lease = await runner.buffers.lease("owner")
    events = step.events()
    try:
        await anext(events)
        assert store.holds == [{0}]
        await _first_batch_ended(step)
        second = await anext(events)
        assert isinstance(second, GroupEnded) and second.group_index == 0
        assert store.holds[-1] == {0, 1}, "group 1 started while group 0 is not sent yet"
        await anext(events)
        assert store.holds[-1] == {1}, "group 0 was sent"
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # an async generator (Step.events)
        await runner.drained()
        if step.lease is not None:
            await step.lease.end()


async def test_stopping_the_groups_in_flight_aborts_them_in_one_call() -> None:
    """At the target every group still in flight stops at once: one abort names all their samples
    (it was one abort per group, each a fan-out to every engine: 60 engine calls for 30 groups on
    two engines, where slime's loop sends one Abort)."""
    calls: list[list[str]] = []

    async def record(request_ids: list[str]) -> object:
        calls.append(list(request_ids))
        return None

    engine = FakeEngine("a", [])
    pool = EnginePool([engine.url], {engine.url: engine}.__getitem__)
    runner = StepRunner(Rollout(pool, Admission(4, 4), InFlightRegistry()), record, lambda config: None)
    groups = [PromptGroup(g, Sample(prompt_ids=(1, 2, g)), prompt_index=2 * g) for g in range(3)]
    spec = StepSpec("stop", groups, 2, SamplingParams(max_new_tokens=2), GenerateOptions(), target_groups=1)
    step = Step(runner, spec, ANONYMOUS.identity, None, 0, None, None, [])
    ids = {g.group_index: [f"stop/g{g.group_index}/s{i}" for i in range(2)] for g in groups}
    for g in groups:
        step.active[g.group_index] = GroupRun(g, [], ids[g.group_index])
    step._stop(step.active[0])  # an earlier stop of one group (its own abort)
    step._stop_all("the target was reached")
    await runner.drained()
    assert calls == [ids[0], ids[1] + ids[2]], "one abort for the groups still running, none again for 0"
    assert all(run.stopping and run.stopped.is_set() for run in step.active.values())


async def test_a_batchs_first_group_reaches_its_engine_before_the_last_group_is_prepared() -> None:
    """Starting a batch, each group's samples go to the engine while the next groups are prepared.
    The event loop used to run every group's coordinator, then every sample's first step, before
    the first engine call, so a 32-group batch's first request left 0.1-0.2 s after the batch
    started (bench/step_trace.py), while slime's loop over Generate sends its first at once."""
    order: list[str] = []

    class Recording(FakeEngine):
        async def generate(self, call: EngineCall) -> AsyncIterator[EngineEvent]:
            order.append("engine call")
            async for event in super().generate(call):
                yield event

    engine = Recording("a", [[tokens(10, 11), final(n=2)]])
    pool = EnginePool([engine.url], {engine.url: engine}.__getitem__)
    runner = StepRunner(Rollout(pool, Admission(64, 64), InFlightRegistry()), _no_abort, lambda config: None)
    groups = [PromptGroup(g, Sample(prompt_ids=(1, 2, g)), prompt_index=2 * g) for g in range(4)]
    spec = StepSpec("order", groups, 2, SamplingParams(max_new_tokens=2), GenerateOptions(), target_groups=4)
    step = Step(runner, spec, ANONYMOUS.identity, None, 0, None, None, [])
    coordinate = step._coordinate

    async def noted(run: GroupRun) -> GroupDone:
        order.append(f"group {run.group.group_index} prepared")
        return await coordinate(run)

    step._coordinate = noted  # type: ignore[method-assign]
    events = step.events()
    try:
        first = await anext(events)
        assert isinstance(first, Progress) and first.in_flight == 4, "slime's rule: one batch of 4 groups"
        await asyncio.wait([run.task for run in step.active.values() if run.task is not None])
        calls_first = order[: order.index("group 3 prepared")]
        assert "engine call" in calls_first, f"no engine call before the last group was prepared: {order}"
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # an async generator (Step.events)
        await runner.drained()


async def test_a_stop_while_a_batch_starts_leaves_its_remaining_groups_unstarted() -> None:
    """The batch's groups start one scheduling round apart: an Abort of the caller's arriving
    meanwhile stops the started ones, and the rest are never started (the summary lists them
    unstarted, the over-sampling count does not include them)."""
    engine = FakeEngine("a", [[tokens(10, 11), final(n=2)]])
    pool = EnginePool([engine.url], {engine.url: engine}.__getitem__)
    runner = StepRunner(Rollout(pool, Admission(64, 64), InFlightRegistry()), _no_abort, lambda config: None)
    groups = [PromptGroup(g, Sample(prompt_ids=(1, 2, g)), prompt_index=2 * g) for g in range(4)]
    spec = StepSpec("stop", groups, 2, SamplingParams(max_new_tokens=2), GenerateOptions(), target_groups=4)
    step = Step(runner, spec, ANONYMOUS.identity, None, 0, None, None, [])
    coordinate = step._coordinate

    async def abort_at_group_1(run: GroupRun) -> GroupDone:
        if run.group.group_index == 1:
            step._on_owner_abort()  # what an Abort(mine) of this caller does to its step
        return await coordinate(run)

    step._coordinate = abort_at_group_1  # type: ignore[method-assign]
    ended = [event async for event in step.events()]
    await runner.drained()
    summary = ended[-1]
    assert isinstance(summary, Summary) and summary.unstarted == [2, 3], summary
    assert sorted(e.group_index for e in ended if isinstance(e, GroupEnded)) == [0, 1]
    assert step.counters.submitted == 2
