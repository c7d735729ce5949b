"""Metrics scraped from a live replica, the per-Generate log line, and OpenTelemetry traces."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, MutableMapping
from typing import Any

import aiohttp
import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.client import make_sample, pb
from rollout_grpc.server.app import RolloutServer, ServerConfig
from rollout_grpc.server.facade.calls import CallRecord
from rollout_grpc.server.security.redact import engine_label
from rollout_grpc.sim.app import RECEIVED_HEADERS
from tests.harness import Harness, harness, sim_engines

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
WAIT_S = 10.0


async def scrape(port: int) -> Samples:
    """GET /metrics over real HTTP and parse the exposition format."""
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def stub(h: Harness) -> pb_grpc.RolloutServiceAsyncStub:
    """The harness client's stub, typed as the grpc.aio stub it is."""
    return h.client.stub


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def request(tokens: int, request_id: str = "", **sample: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        sample=make_sample([5, 6, 7, 8], **sample),  # type: ignore[arg-type]
        sampling_params=pb.SamplingParams(max_new_tokens=tokens, ignore_eos=True),
        request_id=request_id,
    )


class Ended:
    """Waits (with a bound) until the replica has finished observing N more RPCs of one method."""

    def __init__(self, h: Harness, method: str = "Generate") -> None:
        self.records: list[CallRecord] = []
        self._changed = asyncio.Event()
        self._method = method
        h.server.calls.listeners.append(self._on_call)

    def _on_call(self, record: CallRecord) -> None:
        if record.method == self._method:
            self.records.append(record)
            self._changed.set()

    async def wait(self, count: int) -> list[CallRecord]:
        async with asyncio.timeout(WAIT_S):
            while len(self.records) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.records


@pytest.fixture
async def slow() -> AsyncIterator[Harness]:
    """One slow engine (20 ms/token), one slot and no queue: a second call is refused."""
    async with harness(
        "sim",
        sim_config={"token_delay_s": 0.02},
        metrics_port=0,
        server_concurrency=1,
        max_queue=0,
    ) as h:
        yield h


async def first_delta(call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]) -> None:
    async with asyncio.timeout(WAIT_S):
        async for message in call:
            if message.HasField("delta") and message.delta.token_ids:
                return


async def test_final_only_time_to_first_token_is_the_engines_first_token(slow: Harness) -> None:
    """A `final_only` Generate streams nothing, yet its TTFT is the engine's first token: the
    simulator spends `token_delay_s` on every token after the first, so the end comes at least
    (tokens - 1) x delay after it. (Before: TTFT was taken at the final sample, so TTFT = latency
    and TPOT = 0 on the main path, and the dashboard plotted both.)"""
    h = slow
    port = h.server.metrics_port
    assert port
    tokens = 40
    delay = h.sims[0].config.token_delay_s
    engine_time = (tokens - 1) * delay  # the simulator's own floor for the time after the first token
    ended = Ended(h)
    req = request(tokens, "final-only-ttft")
    req.options.final_only = True
    messages = [m async for m in stub(h).Generate(req)]
    assert [m.HasField("sample") for m in messages] == [True]  # no delta: nothing streamed
    assert messages[0].sample.response_length == tokens
    (record,) = await ended.wait(1)
    assert record.ttft_s is not None
    # Half the engine's floor, so a loaded machine reading the first chunk late still passes.
    assert record.ttft_s < record.duration_s - engine_time / 2, (record.ttft_s, record.duration_s)
    samples = await scrape(port)
    assert value(samples, "rollout_grpc_time_to_first_token_seconds_sum") == pytest.approx(record.ttft_s)
    tpot = value(samples, "rollout_grpc_time_per_output_token_seconds_sum")
    assert tpot >= delay / 2, tpot  # per token, at least half the simulator's delay


async def test_metrics_move_with_generations_refusals_aborts_and_pauses(slow: Harness) -> None:
    h = slow
    port = h.server.metrics_port
    assert port
    before = await scrape(port)
    assert value(before, "rollout_grpc_engine_usable", engine=engine_label(h.sims[0].url)) == 1.0
    assert value(before, "rollout_grpc_admission_limit") == 1.0
    ended = Ended(h)

    # Two complete generations of 6 tokens each.
    for i in range(2):
        async for _ in stub(h).Generate(request(6, f"ok-{i}")):
            pass
    await ended.wait(2)
    after = await scrape(port)
    assert value(after, "rollout_grpc_generations_total", status="TRUNCATED") == 2
    assert value(after, "rollout_grpc_generation_tokens_total") == 12
    assert value(after, "rollout_grpc_time_to_first_token_seconds_count") == 2
    assert value(after, "rollout_grpc_time_per_output_token_seconds_count") == 2
    assert value(after, "rollout_grpc_e2e_request_latency_seconds_count") == 2
    assert value(after, "rollout_grpc_request_queue_time_seconds_count") == 2
    handled = value(after, "rollout_grpc_grpc_server_handled_total", grpc_method="Generate", grpc_code="OK")
    assert handled == 2

    # A long generation holds the only slot: the next one is refused.
    long_call = stub(h).Generate(request(5000, "long"))
    await first_delta(long_call)
    during = await scrape(port)
    assert value(during, "rollout_grpc_num_requests_running") == 1
    assert value(during, "rollout_grpc_engine_in_flight", engine=engine_label(h.sims[0].url)) == 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stub(h).Generate(request(4, "refused")):
            pass
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    # Abort(all) ends it ABORTED; Pause/Resume are timed.
    await stub(h).Abort(pb.AbortRequest(all=True))
    async for _ in long_call:
        pass
    await stub(h).Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP))
    paused = await scrape(port)
    assert value(paused, "rollout_grpc_engine_paused", engine=engine_label(h.sims[0].url)) == 1
    await stub(h).Resume(pb.ResumeRequest(weight_version="v7"))
    await ended.wait(4)
    end = await scrape(port)
    assert value(end, "rollout_grpc_admission_rejections_total") == 1
    assert value(end, "rollout_grpc_generations_total", status="RESOURCE_EXHAUSTED") == 1
    assert value(end, "rollout_grpc_generations_total", status="ABORTED") == 1
    assert value(end, "rollout_grpc_aborts_total", target="all") == 1
    assert value(end, "rollout_grpc_aborted_generations_total", target="all") == 1
    assert value(end, "rollout_grpc_abort_all_duration_seconds_count") == 1
    assert value(end, "rollout_grpc_pause_duration_seconds_count") == 1
    assert value(end, "rollout_grpc_engine_paused", engine=engine_label(h.sims[0].url)) == 0
    assert value(end, "rollout_grpc_num_requests_running") == 0
    version = value(
        end,
        "rollout_grpc_engine_weight_version_info",
        engine=engine_label(h.sims[0].url),
        weight_version="v7",
    )
    assert version == 1
    code = value(end, "rollout_grpc_grpc_server_handled_total", grpc_method="Generate", grpc_code="OK")
    assert code == 3


async def test_metrics_report_engine_capability_problems() -> None:
    async with harness("sim", sim_config={"scale_out": False}, metrics_port=0) as h:
        assert h.server.metrics_port
        samples = await scrape(h.server.metrics_port)
        assert value(samples, "rollout_grpc_engine_usable", engine=engine_label(h.sims[0].url)) == 0
        assert (
            value(samples, "rollout_grpc_engine_capability_problems", engine=engine_label(h.sims[0].url)) == 1
        )


def _done(logs: list[MutableMapping[str, Any]], request_id: str) -> MutableMapping[str, Any]:
    lines = [e for e in logs if e.get("event") == "generate_done" and e.get("request_id") == request_id]
    assert len(lines) == 1, f"{request_id}: {lines}"
    return lines[0]


async def test_every_generate_that_ends_leaves_one_log_line(slow: Harness) -> None:
    h = slow
    ended = Ended(h)
    with capture_logs() as logs:
        # Completed, with its identity.
        async for _ in stub(h).Generate(request(4, "done-1", index=3, group_index=2, session_id="s")):
            pass
        # Cancelled by the caller after its first tokens.
        call = stub(h).Generate(request(5000, "cancelled-1"))
        await first_delta(call)
        call.cancel()
        await ended.wait(2)
        # Near its deadline (the engine needs 100 s for 5000 tokens): the replica ends it with its
        # sample just before (ABORTED, code OK), or DEADLINE_EXCEEDED when a loaded machine misses
        # the margin; either way one line with that code.
        late_code = "OK"
        try:
            async for _ in stub(h).Generate(request(5000, "late-1"), timeout=0.5):
                pass
        except grpc.aio.AioRpcError as exc:
            late_code = exc.code().name
        assert late_code in ("OK", "DEADLINE_EXCEEDED"), late_code
        await ended.wait(3)
        # Refused: a long call holds the only slot.
        holder = stub(h).Generate(request(5000, "holder"))
        await first_delta(holder)
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stub(h).Generate(request(4, "refused-1")):
                pass
        # Invalid: no request id given, so the replica makes one up for the line.
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stub(h).Generate(pb.GenerateRequest()):
                pass
        holder.cancel()
        await ended.wait(6)

    done = _done(logs, "done-1")
    assert done["status"] == "TRUNCATED" and done["code"] == "OK"
    assert (done["sample_index"], done["group_index"], done["session_id"]) == (3, 2, "s")
    assert done["engines"] == [h.sims[0].url] and done["new_tokens"] == 4
    assert isinstance(done["ttft_ms"], float) and isinstance(done["queue_wait_ms"], float)
    assert done["weight_versions"]
    assert _done(logs, "cancelled-1")["code"] == "CANCELLED"
    late = _done(logs, "late-1")
    assert late["code"] == late_code
    assert late_code != "OK" or late["status"] == "ABORTED"
    refused = _done(logs, "refused-1")
    assert refused["code"] == "RESOURCE_EXHAUSTED" and refused["status"] == "RESOURCE_EXHAUSTED"
    invalid = [e for e in logs if e.get("event") == "generate_done" and e.get("code") == "INVALID_ARGUMENT"]
    assert len(invalid) == 1 and invalid[0]["request_id"]


async def test_debug_level_logs_each_engine_call(slow: Harness) -> None:
    with capture_logs() as logs:
        async for _ in stub(slow).Generate(request(4, "dbg-1")):
            pass
    calls = [e for e in logs if e.get("event") == "engine_call" and e.get("request_id") == "dbg-1"]
    assert calls and str(calls[0]["url"]).endswith("/inference/v1/generate")
    assert calls[0]["status"] == 200


async def test_each_failover_decision_leaves_one_line() -> None:
    async with harness("sim", sim_count=2, sim_config={"token_delay_s": 0.001}) as h:
        for sim in h.sims:
            sim.faults.drop_connection = -1
            sim.faults.drop_after_tokens = 10
        with capture_logs() as logs:
            async for _ in stub(h).Generate(request(100, "fo-1")):
                pass
    decisions = [e for e in logs if e.get("event") == "failover" and e.get("request_id") == "fo-1"]
    calls = [e for e in logs if e.get("event") == "engine_call" and e.get("request_id") == "fo-1"]
    generates = [c for c in calls if str(c["url"]).endswith("/inference/v1/generate")]
    # One decision per failed engine call, then one when no engine is left.
    assert [d["failure"] for d in decisions] == ["unavailable"] * len(generates) + ["no_engine"]
    assert len(generates) >= 2
    assert decisions[0]["action"] == "retry_elsewhere" and decisions[0]["log_level"] == "warning"
    assert decisions[0]["tokens_this_call"] == 10 and decisions[0]["tokens_so_far"] == 10
    assert decisions[-1]["action"] == "finish" and decisions[-1]["log_level"] == "debug"
    assert decisions[-1]["tokens_so_far"] == 10 * len(generates)
    assert not [e for e in logs if e.get("event") == "generation"]  # `generate_done` is the one line


TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


async def test_traces_continue_the_callers_context_to_the_engine() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with sim_engines(1) as sims:
        server = RolloutServer(
            ServerConfig(engines=[sims[0].url], port=0, health_port=None), tracer_provider=provider
        )
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                traced = pb_grpc.RolloutServiceStub(channel)
                metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
                req = request(4, "traced-1", index=9, group_index=4, session_id="sess")
                async for _ in traced.Generate(req, metadata=metadata):
                    pass
        finally:
            await server.stop(grace_s=0.5)
    spans = exporter.get_finished_spans()
    find: Callable[[SpanKind, str], list] = lambda kind, name: [  # type: ignore[type-arg]  # noqa: E731
        s for s in spans if s.kind == kind and s.name == name
    ]
    (rpc,) = find(SpanKind.SERVER, "rollout.v1.RolloutService/Generate")
    assert format(rpc.context.trace_id, "032x") == TRACE_ID
    assert rpc.parent is not None and format(rpc.parent.span_id, "016x") == PARENT_ID
    assert rpc.attributes is not None
    assert rpc.attributes["rollout.request_id"] == "traced-1"
    assert (rpc.attributes["rollout.sample_index"], rpc.attributes["rollout.group_index"]) == (9, 4)
    assert rpc.attributes["rollout.session_id"] == "sess"
    (engine_call,) = find(SpanKind.CLIENT, "POST /inference/v1/generate")
    assert engine_call.parent is not None and engine_call.parent.span_id == rpc.context.span_id
    assert engine_call.attributes is not None and engine_call.attributes["rollout.request_id"] == "traced-1"
    # The engine received the trace context, with the engine-call span as its parent.
    received = [h for path, h in sims[0].app[RECEIVED_HEADERS] if path == "/inference/v1/generate"]
    assert received, "the engine saw no generate call"
    sent = received[-1]["traceparent"]
    assert sent == f"00-{TRACE_ID}-{format(engine_call.context.span_id, '016x')}-01"
