"""`Rollout` without HTTP: scripted fake engines drive the generation loop and its failover."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, Unavailable
from rollout_grpc.server.domain.model import (
    GenerateOptions,
    MultimodalFeatures,
    MultimodalItem,
    Sample,
    SamplingParams,
    Status,
    TokenBatch,
)
from rollout_grpc.server.engines.api import (
    EngineCapabilities,
    EngineDelta,
    EngineHung,
    EngineMalformed,
    EngineRejected,
    EngineRequestFailed,
    EngineUnavailable,
    FinishKind,
    MediaCacheMiss,
)
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.batching import StreamBatcher, tokens_per_message
from rollout_grpc.server.rollout.generation import Rollout, RolloutConfig
from rollout_grpc.server.rollout.inflight import InFlightRegistry
from tests.support.fake_engine import HANG, FakeEngine, final, tokens

PROMPT = [1, 2, 3]


def make(*engines: FakeEngine, **config: Any) -> Rollout:
    """A Rollout over `engines`; the first one is picked first (the others look busier)."""
    by_url = {e.url: e for e in engines}
    pool = EnginePool(list(by_url), by_url.__getitem__)
    for handle in pool.engines[1:]:
        handle.in_flight = 1
    return Rollout(pool, Admission(16, 16), InFlightRegistry(), RolloutConfig(**config))


async def run(
    rollout: Rollout,
    sample: Sample | None = None,
    params: SamplingParams | None = None,
    rid: str = "r",
    deadline: float | None = None,
) -> tuple[list[TokenBatch], Sample]:
    sample = sample or Sample(prompt_ids=tuple(PROMPT))
    before = sample.response_length
    params = params or SamplingParams(max_new_tokens=6)
    options = GenerateOptions(stream_batch_tokens=1, stream_batch_interval_s=0, deadline=deadline)
    batches: list[TokenBatch] = []
    result: Sample | None = None
    async for item in rollout.generate(sample, params, options, rid):
        if isinstance(item, TokenBatch):
            batches.append(item)
        else:
            result = item
    assert result is not None
    streamed = [t for b in batches for t in b.token_ids]
    new = result.response_length - before
    assert streamed == list(result.iter_token_ids())[result.token_count - new :], (
        "the stream equals the final sample"
    )
    return batches, result


async def test_happy_path_fills_the_sample() -> None:
    a = FakeEngine("a", [[tokens(10, 11), tokens(12), final(FinishKind.STOP, 3)]])
    _, sample = await run(make(a))
    assert sample.status == Status.COMPLETED and list(sample.iter_token_ids()) == [*PROMPT, 10, 11, 12]
    assert sample.rollout_log_probs == [-0.5] * 3 and sample.loss_mask == [1] * 3
    assert [(s.version, s.start, s.end) for s in sample.weight_versions] == [("v1", 0, 3)]
    assert a.calls[0].max_tokens == 6 and a.calls[0].attempt == 0


async def test_mid_stream_drop_continues_on_another_engine_from_the_tokens_so_far() -> None:
    a = FakeEngine("a", [[tokens(10, 11), EngineUnavailable("a", "connection reset")]])
    b = FakeEngine("b", [[tokens(12), final(FinishKind.LENGTH, 1)]])
    rollout = make(a, b)
    _, sample = await run(rollout, params=SamplingParams(max_new_tokens=3))
    assert sample.status == Status.TRUNCATED and list(sample.iter_token_ids()) == [*PROMPT, 10, 11, 12]
    (call,) = b.calls
    assert list(call.prompt_token_ids[: len(PROMPT) + 2]) == [*PROMPT, 10, 11]
    assert call.attempt == 1 and call.max_tokens == 1
    assert not rollout.pool.get("a").healthy  # type: ignore[union-attr]
    assert [s.version for s in sample.weight_versions] == ["unknown", "v1"]


async def test_in_stream_rejection_before_tokens_names_the_field() -> None:
    a = FakeEngine("a", [[EngineRejected("a", "token_id(s) [5000] in stop_token_ids ...", "stop_token_ids")]])
    with pytest.raises(InvalidArgument) as info:
        await run(make(a))
    assert info.value.field == "sampling_params.stop_token_ids"


async def test_rejection_without_param_names_the_tokens() -> None:
    a = FakeEngine("a", [[EngineRejected("a", "Token id 999999 is out of vocabulary")]])
    with pytest.raises(InvalidArgument) as info:
        await run(make(a))
    assert info.value.field == "sample.tokens"


async def test_rejection_after_tokens_fails_the_sample_keeping_them() -> None:
    a = FakeEngine("a", [[tokens(10), EngineRejected("a", "bad")]])
    _, sample = await run(make(a))
    assert sample.status == Status.FAILED and list(sample.iter_token_ids()) == [*PROMPT, 10]


async def test_request_specific_failure_never_opens_breakers() -> None:
    engines = [FakeEngine(u, [[EngineRequestFailed(u, "HTTP 500: Internal server error")]]) for u in "abc"]
    rollout = make(*engines, max_request_failures=2)
    with pytest.raises(FailedPrecondition, match="request itself"):
        await run(rollout)
    assert all(e.healthy for e in rollout.pool.engines)
    assert sum(len(e.calls) for e in engines) == 2


async def test_engine_wide_failure_opens_the_breaker_and_fails_over() -> None:
    a = FakeEngine("a", [[EngineRequestFailed("a", "HTTP 500")]], healthy=False)
    b = FakeEngine("b", [[tokens(7), final(FinishKind.STOP, 1)]])
    rollout = make(a, b)
    _, sample = await run(rollout)
    assert sample.status == Status.COMPLETED
    assert not rollout.pool.get("a").healthy  # type: ignore[union-attr]


def media(kwargs: bytes | None) -> MultimodalFeatures:
    return MultimodalFeatures({"image": [MultimodalItem("h1", 1, 2, kwargs, None, 9)]})


async def test_media_cache_miss_resends_the_tensors_to_the_same_engine() -> None:
    a = FakeEngine("a", [[MediaCacheMiss("a", "miss")], [tokens(5), final(FinishKind.STOP, 1)]])
    sample = Sample(prompt_ids=(1, 9, 9, 3), features=media(b"kw"))
    _, out = await run(make(a), sample)
    assert out.status == Status.COMPLETED
    assert [c.resend_media for c in a.calls] == [False, True]


async def test_media_cache_miss_without_tensors_asks_to_render_again() -> None:
    a = FakeEngine("a", [[MediaCacheMiss("a", "miss")]])
    with pytest.raises(FailedPrecondition, match="render"):
        await run(make(a), Sample(prompt_ids=(1, 9, 9, 3), features=media(None)))


async def test_every_engine_dying_before_any_token_is_unavailable_not_an_empty_sample() -> None:
    a = FakeEngine("a", [[EngineUnavailable("a", "refused")]])
    b = FakeEngine("b", [[EngineUnavailable("b", "refused")]])
    with pytest.raises(Unavailable):
        await run(make(a, b))


async def test_malformed_reply_is_retried_and_nothing_is_lost() -> None:
    a = FakeEngine(
        "a", [[tokens(10), EngineMalformed("a", "bad JSON")], [tokens(11), final(FinishKind.STOP, 1)]]
    )
    _, sample = await run(make(a))
    assert sample.status == Status.COMPLETED and list(sample.iter_token_ids()) == [*PROMPT, 10, 11]
    assert "bad JSON" in sample.engine_attempts[0].error


async def test_malformed_replies_to_the_attempt_limit_fail_the_sample_with_its_tokens() -> None:
    a = FakeEngine("a", [[tokens(10), EngineMalformed("a", "bad JSON")]])
    _, sample = await run(make(a, max_engine_attempts=3), params=SamplingParams(max_new_tokens=10))
    assert sample.status == Status.FAILED and sample.response_length == 3
    assert len(a.calls) == 3


async def test_hung_engine_fails_over() -> None:
    a = FakeEngine("a", [[tokens(10), EngineHung("a", "silent")]])
    b = FakeEngine("b", [[tokens(11), final(FinishKind.STOP, 1)]])
    _, sample = await run(make(a, b))
    assert sample.status == Status.COMPLETED and list(sample.iter_token_ids()) == [*PROMPT, 10, 11]


async def test_budget_exhausted_by_a_dropped_call_truncates() -> None:
    a = FakeEngine("a", [[tokens(10, 11), EngineUnavailable("a", "reset")]])
    b = FakeEngine("b", [[final()]])
    _, sample = await run(make(a, b), params=SamplingParams(max_new_tokens=2))
    assert sample.status == Status.TRUNCATED and not b.calls


async def _abort_when_started(rollout: Rollout, engine: FakeEngine, rid: str) -> None:
    await engine.started.wait()
    (entry,) = rollout.registry.select([rid])[0]
    entry.request_abort("test")


async def test_abort_ends_promptly_even_if_the_engine_never_answers() -> None:
    a = FakeEngine("a", [[tokens(10, 11), HANG]])
    rollout = make(a, abort_drain_s=0.05)
    aborter = asyncio.create_task(_abort_when_started(rollout, a, "r"))
    _, sample = await asyncio.wait_for(run(rollout, rid="r"), 5)
    await aborter
    assert sample.status == Status.ABORTED and list(sample.iter_token_ids()) == [*PROMPT, 10, 11]
    assert [s.version for s in sample.weight_versions] == ["unknown"]


async def test_abort_with_a_hung_engine_does_not_fail_over() -> None:
    a = FakeEngine("a", [[tokens(10), HANG]])
    b = FakeEngine("b", [[tokens(11), final(FinishKind.STOP, 1)]])
    rollout = make(a, b, abort_drain_s=0.05)
    aborter = asyncio.create_task(_abort_when_started(rollout, a, "r"))
    _, sample = await asyncio.wait_for(run(rollout, rid="r"), 5)
    await aborter
    assert sample.status == Status.ABORTED and list(sample.iter_token_ids())[len(PROMPT) :] == [10]
    assert not b.calls and rollout.pool.get("a").healthy  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------ dead engines, deadlines


async def test_a_probe_finding_the_engine_dead_fails_a_silent_stream_over_at_once() -> None:
    a = FakeEngine("a", [[tokens(10, 11), HANG]])
    b = FakeEngine("b", [[tokens(12), final(FinishKind.LENGTH, 1)]])
    rollout = make(a, b)
    task = asyncio.create_task(run(rollout, rid="r"))
    await a.started.wait()
    a.healthy = False
    handle = rollout.pool.get("a")
    assert handle is not None
    assert not await rollout.pool.probe(handle)  # the probe, not the idle timeout, finds it
    _, sample = await asyncio.wait_for(task, 5)
    assert list(sample.iter_token_ids()) == [*PROMPT, 10, 11, 12]
    assert [e.engine for e in sample.engine_attempts] == ["a", "b"]
    assert "health probe" in sample.engine_attempts[0].error
    assert sample.engine_attempts[1].start == 2  # continued from the tokens produced


async def test_a_stream_that_got_tokens_since_the_probe_began_is_not_failed_over() -> None:
    """A probe that timed out on a slow engine is no proof of death for a stream still fed."""
    a = FakeEngine("a", [[tokens(10), HANG]])
    b = FakeEngine("b", [[tokens(12), final(FinishKind.LENGTH, 1)]])
    rollout = make(a, b, abort_drain_s=0.05)
    task = asyncio.create_task(run(rollout, rid="r"))
    await a.started.wait()
    handle = rollout.pool.get("a")
    assert handle is not None
    handle.declare_dead(probe_started=time.monotonic() - 60)  # began before the stream's token
    (entry,) = rollout.registry.select(["r"])[0]
    entry.request_abort("test")  # ends the stream, which must still be on engine a
    _, sample = await asyncio.wait_for(task, 5)
    assert sample.status == Status.ABORTED and [e.engine for e in sample.engine_attempts] == ["a"]
    assert not b.calls


async def test_a_callers_deadline_ends_a_hung_stream_with_its_tokens_before_it_expires() -> None:
    a = FakeEngine("a", [[tokens(10, 11), HANG]])
    rollout = make(a, deadline_margin_s=1.0)
    deadline = time.monotonic() + 0.5  # margin: min(1 s, 10 % of 0.5 s) = 50 ms
    _, sample = await asyncio.wait_for(run(rollout, deadline=deadline), 5)
    assert time.monotonic() < deadline
    assert sample.status == Status.ABORTED and list(sample.iter_token_ids()) == [*PROMPT, 10, 11]
    handle = rollout.pool.get("a")
    assert handle is not None and handle.healthy  # a slow engine is not blamed for a deadline


async def test_a_callers_deadline_aborts_the_engine_call_upstream_before_the_sample_is_due() -> None:
    """The engine gets an abort for the call (its final chunk would bring buffered tokens); one
    that never answers it still loses the caller nothing past the stop point."""
    a = FakeEngine("a", [[tokens(10, 11), HANG]])
    rollout = make(a, deadline_margin_s=1.0)
    deadline = time.monotonic() + 0.5  # abort at 0.5 - 50 ms - 50 ms, stop at 0.5 - 50 ms
    _, sample = await asyncio.wait_for(run(rollout, deadline=deadline), 5)
    assert time.monotonic() < deadline
    assert sample.status == Status.ABORTED and list(sample.iter_token_ids()) == [*PROMPT, 10, 11]
    (call,) = a.calls
    assert a.aborted == [a.engine_request_id(call.call_id)]


async def test_a_callers_deadline_ends_a_queued_generation_before_it_expires() -> None:
    a = FakeEngine("a", [[tokens(10), HANG]])
    by_url = {"a": a}
    pool = EnginePool(["a"], by_url.__getitem__)
    rollout = Rollout(pool, Admission(1, 4), InFlightRegistry(), RolloutConfig(abort_drain_s=0.05))
    holder = asyncio.create_task(run(rollout, rid="holder"))  # holds the only slot
    await a.started.wait()
    deadline = time.monotonic() + 0.3
    _, sample = await asyncio.wait_for(run(rollout, rid="queued", deadline=deadline), 5)
    assert time.monotonic() < deadline
    assert sample.status == Status.ABORTED and sample.response_length == 0
    assert len(a.calls) == 1  # it never reached an engine
    (entry,) = rollout.registry.select(["holder"])[0]
    entry.request_abort("test")
    await asyncio.wait_for(holder, 5)


async def test_a_deadline_never_cancels_the_callers_own_wait_between_reads() -> None:
    """The deadline interrupts reads of the engine stream only: a caller busy elsewhere (here a
    slow consumer) is never cancelled; its next read ends the call with the sample."""
    a = FakeEngine("a", [[tokens(10), tokens(11), HANG]])
    rollout = make(a)
    deadline = time.monotonic() + 0.3
    options = GenerateOptions(stream_batch_tokens=1, stream_batch_interval_s=0, deadline=deadline)
    seen: list[TokenBatch | Sample] = []
    async for item in rollout.generate(
        Sample(prompt_ids=tuple(PROMPT)), SamplingParams(max_new_tokens=6), options, "r"
    ):
        seen.append(item)
        if len(seen) == 1:
            await asyncio.sleep(0.4)  # the fault under test: a consumer slower than the deadline
    final_sample = seen[-1]
    assert isinstance(final_sample, Sample) and final_sample.status == Status.ABORTED
    assert list(final_sample.iter_token_ids()) == [*PROMPT, 10]  # the next read never started


async def test_empty_delta_marks_the_engine_started() -> None:
    a = FakeEngine("a", [[EngineDelta(), tokens(3), final(FinishKind.STOP, 1)]])
    _, sample = await run(make(a))
    assert sample.status == Status.COMPLETED


async def test_abort_requested_while_rendering_still_bounds_the_call() -> None:
    """An abort that lands before the engine call starts (here: during the prompt render)."""
    a = FakeEngine("a", [[HANG]])
    rollout = make(a, abort_drain_s=0.05)
    render = a.render_text

    async def render_then_abort(text: str, model: str = "") -> Any:
        (entry,) = rollout.registry.select(["r"])[0]
        entry.request_abort("test")
        return await render(text, model)

    a.render_text = render_then_abort  # type: ignore[method-assign]
    _, sample = await asyncio.wait_for(run(rollout, Sample(prompt="hi"), rid="r"), 5)
    assert sample.status == Status.ABORTED and sample.response_length == 0


async def test_a_transient_500_on_a_one_engine_fleet_is_retried_there() -> None:
    a = FakeEngine("a", [[EngineRequestFailed("a", "HTTP 500")], [tokens(4), final(FinishKind.STOP, 1)]])
    _, sample = await run(make(a))
    assert sample.status == Status.COMPLETED and len(a.calls) == 2


def _r3_fleet(*engines: tuple[FakeEngine, EngineCapabilities]) -> Rollout:
    rollout = make(*(engine for engine, _ in engines))
    for handle, (_, caps) in zip(rollout.pool.engines, engines, strict=True):
        handle.capabilities = caps
    return rollout


async def _generate_r3(rollout: Rollout) -> Sample:
    options = GenerateOptions(stream_batch_tokens=1, stream_batch_interval_s=0, return_routed_experts=True)
    result: Sample | None = None
    async for item in rollout.generate(
        Sample(prompt_ids=tuple(PROMPT)), SamplingParams(max_new_tokens=6), options, "r3"
    ):
        if isinstance(item, Sample):
            result = item
    assert result is not None
    return result


DENSE = EngineCapabilities(is_moe=False)
MOE_NO_FLAG = EngineCapabilities(
    is_moe=True, routed_experts=False, routed_experts_flag="--enable-return-routed-experts"
)
MOE_R3 = EngineCapabilities(is_moe=True, routed_experts=True)


async def test_routed_experts_from_engines_that_cannot_return_them_fail_before_any_call() -> None:
    a = FakeEngine("a", [[tokens(10), final(FinishKind.LENGTH, 1)]])
    b = FakeEngine("b", [[tokens(10), final(FinishKind.LENGTH, 1)]])
    with pytest.raises(FailedPrecondition) as info:
        await _generate_r3(_r3_fleet((a, DENSE), (b, MOE_NO_FLAG)))
    assert "engine a serves a dense model" in str(info.value)
    assert "engine b was not started with --enable-return-routed-experts" in str(info.value)
    assert not a.calls and not b.calls


async def test_routed_experts_skip_engines_that_cannot_return_them() -> None:
    dense = FakeEngine("dense", [[tokens(10), final(FinishKind.LENGTH, 1)]])
    moe = FakeEngine("moe", [[tokens(10, 11), final(FinishKind.LENGTH, 2)]])
    sample = await _generate_r3(_r3_fleet((dense, DENSE), (moe, MOE_R3)))
    assert sample.status == Status.TRUNCATED and not dense.calls and len(moe.calls) == 1


async def test_routed_experts_engine_lost_after_tokens_keeps_them_when_no_other_can_route() -> None:
    moe = FakeEngine("moe", [[tokens(10, 11), EngineUnavailable("moe", "connection reset")]])
    dense = FakeEngine("dense", [[tokens(12), final(FinishKind.LENGTH, 1)]])
    sample = await _generate_r3(_r3_fleet((moe, MOE_R3), (dense, DENSE)))
    assert list(sample.iter_token_ids()) == [*PROMPT, 10, 11] and sample.status == Status.ABORTED
    assert not dense.calls


@pytest.mark.parametrize(
    ("limit", "interval_s", "gap_s"),
    [
        (16, 0.2, 0.021),
        (16, 0.2, 0.0235),
        (16, 0.2, 0.049),
        (16, 0.2, 0.0001),
        (64, 0.2, 0.0033),
        (64, 0.2, 0.0075),
        (64, 0.2, 0.011),
        (64, 0.2, 0.02),
        (64, 0.2, 0.021),
        (64, 0.2, 0.033),
        (64, 0.2, 0.3),
        (4, 1.0, 0.011),
    ],
)
def test_the_engine_is_asked_for_the_tokens_of_one_stream_message(
    monkeypatch: pytest.MonkeyPatch, limit: int, interval_s: float, gap_s: float
) -> None:
    """Events of `tokens_per_message` tokens: one message each, none above the limit, the oldest
    token at most two time flushes old, and no more messages than one-token events give."""

    def messages(per_event: int, engine_batch: int) -> list[tuple[float, int, float]]:
        """(when, tokens, age of the oldest token) per message, from the first to the 240th token."""
        clock = [0.0]
        monkeypatch.setattr(time, "monotonic", lambda: clock[0])
        batcher = StreamBatcher(
            GenerateOptions(stream_batch_tokens=limit, stream_batch_interval_s=interval_s)
        )
        batcher.engine_batches(engine_batch)
        out: list[tuple[float, int, float]] = []
        made = sent = 0
        while made < 240:  # the first token alone (vLLM sends it at once), then `per_event` each
            n = 1 if made == 0 else min(per_event, 240 - made)
            made += n
            clock[0] = made * gap_s
            batch = batcher.add(made - n, [7] * n, [0.0] * n, "")
            if batch is not None:
                out.append((clock[0], len(batch.token_ids), clock[0] - (sent + 1) * gap_s))
                sent += len(batch.token_ids)
        return out

    asked = tokens_per_message(limit, interval_s, gap_s)
    assert 1 <= asked <= limit
    batched, single = messages(asked, asked), messages(1, 1)
    if asked > 1:  # single tokens are held until the next one arrives after the flush is due
        assert all(tokens <= asked for _, tokens, _ in batched)
        assert sum(tokens for _, tokens, _ in batched[1:-1]) == asked * len(batched[1:-1])  # event = message
    assert max(age for _, _, age in batched) <= 2 * interval_s + 1e-9
    assert len(batched) <= len(single)


def test_without_a_time_flush_or_a_measured_speed_the_engine_batch_is_the_message_or_one() -> None:
    assert tokens_per_message(16, 0, None) == 16
    assert tokens_per_message(16, 0.2, None) == 1
    assert tokens_per_message(0, 0.2, 0.01) == 1


def test_an_engine_faster_than_measured_sends_no_more_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for 8-token events from a 50 ms/token estimate, an engine at 1 ms/token delivers
    them every 8 ms: they are held to the 16-token count as single tokens would be."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    batcher = StreamBatcher(GenerateOptions(stream_batch_tokens=16, stream_batch_interval_s=0.2))
    asked = tokens_per_message(16, 0.2, 0.05)
    assert asked == 8
    batcher.engine_batches(asked)
    sizes = []
    made = 0
    for n in [1] + [asked] * 10:
        made += n
        clock[0] = made * 0.001
        batch = batcher.add(made - n, [7] * n, [0.0] * n, "")
        if batch is not None:
            sizes.append(len(batch.token_ids))
    assert sizes == [1, 16, 16, 16, 16, 16]


def test_the_default_batching_sends_the_first_token_then_64_token_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the defaults (64 tokens or 200 ms) an engine faster than 64 tokens per 200 ms is asked for
    64-token events and a 256-token response takes ceil(256 / 64) + 2 messages with the final
    sample: the first token alone (TTFT), then one per 64 tokens (the documented bound)."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    options = GenerateOptions()
    assert options.stream_batch_tokens == 64
    asked = tokens_per_message(options.stream_batch_tokens, options.stream_batch_interval_s, 0.001)
    assert asked == 64
    batcher = StreamBatcher(options)
    batcher.engine_batches(asked)
    sizes = []
    made = 0
    while made < 256:
        n = 1 if made == 0 else min(asked, 256 - made)
        made += n
        clock[0] = made * 0.001
        batch = batcher.add(made - n, [7] * n, [0.0] * n, "")
        if batch is not None:
            sizes.append(len(batch.token_ids))
    last = batcher.flush()
    if last is not None:
        sizes.append(len(last.token_ids))
    assert sizes == [1, 64, 64, 64, 63]
    assert len(sizes) + 1 <= math.ceil(256 / options.stream_batch_tokens) + 2


async def test_an_abort_drain_never_cancels_the_callers_own_wait_between_reads() -> None:
    """The abort's drain bound interrupts reads of the engine stream only, as the deadline does: a
    caller busy elsewhere when it expires (here a slow consumer; in the service, a gRPC write) is
    never cancelled — a CancelledError there ends the RPC without a status and the caller waits
    forever. Its next read ends the call with the sample."""
    a = FakeEngine("a", [[tokens(10), tokens(11), HANG]])
    rollout = make(a, abort_drain_s=0.05)
    options = GenerateOptions(stream_batch_tokens=1, stream_batch_interval_s=0)
    seen: list[TokenBatch | Sample] = []
    async for item in rollout.generate(
        Sample(prompt_ids=tuple(PROMPT)), SamplingParams(max_new_tokens=6), options, "r"
    ):
        seen.append(item)
        if len(seen) == 1:
            (entry,) = rollout.registry.select(["r"])[0]
            entry.request_abort("test")
            await asyncio.sleep(0.3)  # the fault under test: a consumer slower than the drain
    final_sample = seen[-1]
    assert isinstance(final_sample, Sample) and final_sample.status == Status.ABORTED
    assert list(final_sample.iter_token_ids()) == [*PROMPT, 10]  # the next read never started
