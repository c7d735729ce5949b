"""One replica in front of a simulated vLLM and a simulated SGLang engine (issue 25).

Both simulators run the same toy model (same model seed), so greedy decoding is one sequence on
either kind and a failover from one kind to the other continues it token for token. Checked here:
failover both ways with the tokens exact, abort-all and pause/resume across kinds, the aborted
samples continued to exactly their budget, session affinity that does not depend on the kind, and
GetServerInfo naming each engine's kind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from rollout_grpc.server.app import RolloutServer
from rollout_grpc.sim import SimEngine
from tests.harness import running_server, sim_engines
from tests.support.fleet import session_on
from tests.support.service import PROMPT, Stream, assert_lossless, start_stream, started

GREEDY: dict[str, object] = {"temperature": 0.0, "max_new_tokens": 120, "ignore_eos": True}


@dataclass
class Mixed:
    server: RolloutServer
    client: AsyncRolloutClient
    vllm: SimEngine
    sglang: SimEngine

    def sample_on(self, engine: SimEngine) -> pb.Sample:
        """A sample whose session the replica's pool sends to `engine`."""
        session = session_on([self.vllm, self.sglang], engine, self.server.pool.pick)
        return make_sample(PROMPT, session_id=session)

    def streams_on_both(self, prefix: str, params: dict[str, object], count: int) -> list[Stream]:
        """`count` streaming Generates started in the background, alternating vLLM and SGLang."""
        engines = [self.vllm, self.sglang]
        return [
            start_stream(self.client, f"{prefix}-{i}", params, sample=self.sample_on(engines[i % 2]))
            for i in range(count)
        ]


@contextlib.asynccontextmanager
async def mixed(token_delay_s: float = 0.002) -> AsyncIterator[Mixed]:
    sim = {"token_delay_s": token_delay_s, "eos_probability": 0.0}
    async with (
        sim_engines(1, **sim) as (vllm,),
        sim_engines(1, **sim, kind="sglang") as (sglang,),
        running_server([vllm.url, sglang.url], engine_kinds={sglang.url: "sglang"}) as server,
        AsyncRolloutClient(f"127.0.0.1:{server.port}", retry=None) as client,
    ):
        yield Mixed(server, client, vllm, sglang)


async def test_server_info_names_each_engines_kind() -> None:
    async with mixed() as m:
        info = await m.client.server_info()
    assert {e.url: e.kind for e in info.engines} == {m.vllm.url: "vllm", m.sglang.url: "sglang"}
    assert all(e.usable for e in info.engines)


async def test_greedy_is_the_same_sequence_on_both_kinds() -> None:
    async with mixed(0.0) as m:
        a = await m.client.generate(m.sample_on(m.vllm), GREEDY)
        b = await m.client.generate(m.sample_on(m.sglang), GREEDY)
    assert a.engine_attempts[0].engine == m.vllm.url and b.engine_attempts[0].engine == m.sglang.url
    assert list(a.tokens) == list(b.tokens) and a.response_length == 120
    assert list(a.rollout_log_probs) == pytest.approx(list(b.rollout_log_probs))


@pytest.mark.parametrize("first", ["vllm", "sglang"])
async def test_failover_between_kinds_continues_the_tokens_exactly(first: str) -> None:
    async with mixed() as m:
        bad, good = (m.vllm, m.sglang) if first == "vllm" else (m.sglang, m.vllm)
        reference = await m.client.generate(m.sample_on(good), GREEDY)
        bad.faults.drop_connection = 1
        bad.faults.drop_after_tokens = 40
        stream = start_stream(m.client, "failover", GREEDY, sample=m.sample_on(bad))
        final = await stream.task
    assert final.status == pb.SAMPLE_STATUS_TRUNCATED and final.response_length == 120
    assert_lossless(stream, final)
    assert list(final.tokens) == list(reference.tokens)  # continued from the 40 tokens, exactly
    attempts = [(a.engine, a.start, a.end) for a in final.engine_attempts]
    assert attempts == [(bad.url, 0, 40), (good.url, 40, 120)]
    assert sum(w.end - w.start for w in final.weight_versions) == 120


async def test_abort_all_across_kinds_then_continue_to_the_budget() -> None:
    async with mixed(0.005) as m:
        params: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True}
        streams = m.streams_on_both("all", params, 6)
        await started(*streams)
        response = await m.client.abort(all=True)
        assert response.aborted == 6 and not response.engine_errors
        samples = await asyncio.gather(*(s.task for s in streams))
        assert {s.engine_attempts[0].engine for s in samples} == {m.vllm.url, m.sglang.url}
        for stream, sample in zip(streams, samples, strict=True):
            assert sample.status == pb.SAMPLE_STATUS_ABORTED and sample.response_length >= 1
            assert_lossless(stream, sample)
        info = await m.client.server_info()
        assert not any(e.paused for e in info.engines)
        # Each aborted sample continues (on whichever engine) to exactly its budget.
        for aborted in samples:
            k = aborted.response_length
            done = await m.client.generate(aborted, params, {"mask_offpolicy": True})
            assert done.status == pb.SAMPLE_STATUS_TRUNCATED and done.response_length == 400
            assert list(done.tokens[: len(aborted.tokens)]) == list(aborted.tokens)
            assert list(done.rollout_log_probs[:k]) == list(aborted.rollout_log_probs)


@pytest.mark.parametrize("mode", ["keep", "wait"])
async def test_pause_resume_across_kinds_splits_versions_or_drains(mode: str) -> None:
    async with mixed(0.003) as m:
        params: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 150, "ignore_eos": True}
        streams = m.streams_on_both(mode, params, 4)
        await started(*streams)
        paused = await m.client.pause(mode)
        assert sorted(paused.paused_engines) == sorted([m.vllm.url, m.sglang.url])
        assert not paused.engine_errors
        if mode == "wait":  # a wait pause answers once everything in flight has finished
            assert all(s.task.done() for s in streams)
        resumed = await m.client.resume(weight_version="step-1")
        assert not resumed.engine_errors
        for stream in streams:
            sample = await stream.task
            assert sample.status == pb.SAMPLE_STATUS_TRUNCATED and sample.response_length == 150
            assert_lossless(stream, sample)
            versions = [w.version for w in sample.weight_versions]
            assert versions == (["default"] if mode == "wait" else ["default", "step-1"]), versions
        info = await m.client.server_info()
        assert info.weight_version == "step-1"
        after = await m.client.generate(make_sample(PROMPT), {**params, "max_new_tokens": 3})
        assert [w.version for w in after.weight_versions] == ["step-1"]


async def test_session_affinity_does_not_depend_on_the_kind() -> None:
    """Rendezvous hashing is over URLs: a mixed fleet routes sessions as the same URLs all-vLLM
    would, from every replica, whatever order each lists them in."""
    async with sim_engines(1) as (vllm,), sim_engines(1, kind="sglang") as (sglang,):
        urls = [vllm.url, sglang.url]
        async with contextlib.AsyncExitStack() as stack:
            mixed_a = await stack.enter_async_context(
                running_server(urls, engine_kinds={sglang.url: "sglang"})
            )
            mixed_b = await stack.enter_async_context(
                running_server(list(reversed(urls)), engine_kinds={sglang.url: "sglang"})
            )
            for i in range(40):
                sid = f"s-{i}"
                a, b = mixed_a.pool.pick(sid), mixed_b.pool.pick(sid)
                assert a is not None and b is not None and a.url == b.url
            clients = [
                await stack.enter_async_context(AsyncRolloutClient(f"127.0.0.1:{s.port}"))
                for s in (mixed_a, mixed_b)
            ]
            chosen: dict[str, set[str]] = {}
            for i in range(10):
                sid = f"s-{i}"
                for client in clients:
                    sample = await client.generate(make_sample(PROMPT, session_id=sid), {"max_new_tokens": 2})
                    chosen.setdefault(sid, set()).add(sample.engine_attempts[0].engine)
    assert all(len(engines) == 1 for engines in chosen.values())
    assert {next(iter(e)) for e in chosen.values()} == set(urls), "sessions should use both kinds"
