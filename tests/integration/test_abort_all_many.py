"""Abort(all) of a trainer's whole batch at once: no token the engines produced is lost.

Abort(all) runs at every weight update with every generation in flight. Its engine pauses go out
before the local generations are marked (`Control.abort_all`), and hundreds of streams then end in
the same moment; this holds the outcome of that at scale: every stream ends ABORTED with exactly
the tokens it streamed, and together the samples carry every token the engines generated.
"""

from __future__ import annotations

import asyncio
import gc

from rollout_grpc.client import pb
from tests.harness import harness
from tests.support.service import assert_lossless, start_stream, started

#: Generations aborted at once (two engines, within the replica's in-flight limit).
IN_FLIGHT = 1024
#: Slow enough that 1024 streams in one test process (client, replica and both engines, under
#: coverage on a loaded CI machine) all start long before they would end: 1 token/s per stream.
#: At 4 tokens/s a slow CI machine's loop was saturated by the ~900 streams already running and
#: grpc.aio, which takes up one new call per loop turn, took 90 s to start the last hundred.
SIM: dict[str, object] = {"token_delay_s": 1.0}
PARAMS: dict[str, object] = {"temperature": 1.0, "max_new_tokens": 2048, "ignore_eos": True}
#: Batched deltas: one message per token would make the test measure its own client.
BATCHED: dict[str, object] = {"stream_batch_tokens": 4, "stream_batch_interval_ms": 0}


async def test_abort_all_of_1024_generations_delivers_every_token() -> None:
    async with harness("sim", None, sim_count=2, sim_config=SIM) as h:
        for sim in h.sims:
            sim.reset_stats()
        streams = [start_stream(h.client, f"many-{i}", PARAMS, options=BATCHED) for i in range(IN_FLIGHT)]
        await started(*streams)
        response = await h.client.abort(all=True)
        assert response.aborted == IN_FLIGHT
        assert not response.engine_errors
        samples = await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 120)
        for stream, sample in zip(streams, samples, strict=True):
            assert sample.status == pb.SAMPLE_STATUS_ABORTED
            assert sample.finish_reason == pb.FINISH_REASON_ABORT
            assert not sample.failure_reason  # aborted on request, not by a lost engine
            assert sample.response_length >= 1
            assert_lossless(stream, sample)
        produced = sum(sim.stats.generation_tokens_total for sim in h.sims)
        assert sum(sample.response_length for sample in samples) == produced
        assert all(sim.stats.pause_calls == 1 and sim.stats.resume_calls == 1 for sim in h.sims)
        info = await h.client.server_info()
        assert not any(engine.paused for engine in info.engines)


async def test_abort_all_gives_the_collector_back_as_it_found_it() -> None:
    """Abort(all) holds the garbage collector off while it runs (`rollout/collector.py`), and leaves
    it on when it was on, off when the operator had turned it off."""
    async with harness("sim", None, sim_config=SIM) as h:
        for was_enabled in (True, False):
            if not was_enabled:
                gc.disable()
            try:
                stream = start_stream(h.client, f"gc-{was_enabled}", PARAMS, options=BATCHED)
                await started(stream)
                response = await h.client.abort(all=True)
                assert response.aborted == 1
                assert (await stream.task).status == pb.SAMPLE_STATUS_ABORTED
                assert gc.isenabled() is was_enabled
            finally:
                gc.enable()
