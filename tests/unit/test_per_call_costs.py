"""The per-call work a Generate does once it ends or starts (the fourteenth pass in
bench/profile_notes.md), made cheaper without changing what it does: the call's log line is not
built when its level is off, the per-call metric children are made once, and an owner's engine-id
tag is hashed once."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any

import aiohttp
import pytest
import structlog
from structlog.testing import CapturingLogger

from rollout_grpc.server.domain.model import EngineAttempt, Finish, Sample, Status
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.engines.registry import adapter_factory
from rollout_grpc.server.facade import calls
from rollout_grpc.server.facade.calls import CallRecord, Door
from rollout_grpc.server.observe.metrics import Metrics
from rollout_grpc.server.rollout import call_ids
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.call_ids import CallIds


class CountingRecord(CallRecord):
    """A record that counts how often the log line's derived fields are read."""

    reads = 0

    @property
    def engines(self) -> list[str]:
        CountingRecord.reads += 1
        return CallRecord.engines.__get__(self)  # type: ignore[no-any-return]


def _record(code: str = "OK", sample: bool = True) -> CountingRecord:
    record = CountingRecord(Door.GRPC, "Generate", request_id="r-1", code=code)
    if sample:
        record.sample = Sample(
            prompt_ids=(1, 2),
            response_ids=[3, 4, 5],
            response_length=3,
            status=Status.COMPLETED,
            finish_reason=Finish.LENGTH,
            engine_attempts=[EngineAttempt(engine="engine-a", start=0, end=3)],
        )
    record.ended = record.started + 0.5
    return record


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The calls module's logger replaced by a capturing one filtered at the level asked."""

    def at(level: int) -> CapturingLogger:
        out = CapturingLogger()
        logger = structlog.wrap_logger(
            out, wrapper_class=structlog.make_filtering_bound_logger(level), processors=[]
        )
        monkeypatch.setattr(calls, "log", logger)
        CountingRecord.reads = 0
        return out

    return at


def test_a_successful_calls_line_is_not_built_when_info_is_off(capture: Any) -> None:
    out = capture(logging.WARNING)
    calls.log_call(_record())
    assert out.calls == []
    assert CountingRecord.reads == 0  # before: the fields were built, then dropped


def test_the_line_is_the_same_when_its_level_is_on(capture: Any) -> None:
    out = capture(logging.INFO)
    calls.log_call(_record())
    (call,) = out.calls
    assert call.method_name == "info" and call.kwargs["event"] == "generate_done"
    assert call.kwargs["engines"] == ["engine-a"] and call.kwargs["new_tokens"] == 3
    assert call.kwargs["status"] == "COMPLETED" and call.kwargs["latency_ms"] == 500.0


def test_a_failed_calls_line_is_written_at_warning(capture: Any) -> None:
    out = capture(logging.WARNING)
    record = _record(code="UNAVAILABLE", sample=False)
    record.details = "no engine"
    calls.log_call(record)
    (call,) = out.calls
    assert call.method_name == "warning" and call.kwargs["error"] == "no engine"


async def test_per_call_metrics_count_each_label_set_on_its_own() -> None:
    async with aiohttp.ClientSession() as session:
        metrics = Metrics(EnginePool([], adapter_factory(session)), Admission(1, 0))
    for code, n in (("OK", 3), ("UNAVAILABLE", 2)):
        for _ in range(n):
            metrics.observe(_record(code=code, sample=code == "OK"))
    abort = CallRecord(Door.GRPC, "Abort", code="OK")
    abort.ended = abort.started
    metrics.observe(abort)

    def value(metric: Any, suffix: str, **labels: str) -> float:
        for family in metric.collect():
            for s in family.samples:
                if s.name.endswith(suffix) and s.labels == labels:
                    return float(s.value)
        return 0.0

    assert value(metrics.handled, "_total", grpc_method="Generate", grpc_code="OK") == 3
    assert value(metrics.handled, "_total", grpc_method="Generate", grpc_code="UNAVAILABLE") == 2
    assert value(metrics.handled, "_total", grpc_method="Abort", grpc_code="OK") == 1
    assert value(metrics.handling, "_count", grpc_method="Generate") == 5
    assert value(metrics.handling, "_count", grpc_method="Abort") == 1
    assert value(metrics.generations, "_total", status="COMPLETED") == 3
    assert value(metrics.generations, "_total", status="UNAVAILABLE") == 2


def test_owner_tags_are_hashed_once_and_stay_those_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call_ids, "TAG_CACHE", 4, raising=False)
    ids = CallIds.new()

    def fresh(owner: str) -> str:
        return hmac.new(ids._key, owner.encode(), hashlib.sha256).hexdigest()[: call_ids.TOKEN_HEX]

    hashed: list[bytes] = []
    real = hmac.new

    def counting(key: bytes, msg: bytes, digestmod: Any) -> hmac.HMAC:
        hashed.append(msg)
        return real(key, msg, digestmod)

    monkeypatch.setattr(hmac, "new", counting)
    assert ids.owner_tag("alice") == ids.owner_tag("alice")
    assert hashed == [b"alice"]  # before: one HMAC per engine call
    owners = [f"o{i}" for i in range(10)]
    for owner in owners:
        assert ids.owner_tag(owner) == ids.owner_tag(owner)
        assert len(ids._tags) <= 4  # bounded by TAG_CACHE
    monkeypatch.setattr(hmac, "new", real)
    assert all(ids.owner_tag(o) == fresh(o) for o in ["alice", *owners])
    assert ids.owner_tag("alice") != ids.owner_tag("bob")
