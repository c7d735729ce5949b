"""SGLang's request side and stream parsing, without HTTP: names, rids, errors, chunk modes."""

from __future__ import annotations

import pytest

from rollout_grpc.server.domain import params as params_mod
from rollout_grpc.server.domain.model import SamplingParams
from rollout_grpc.server.engines.api import (
    EngineCall,
    EngineDelta,
    EngineFinal,
    EngineRejected,
    EngineRequestFailed,
    FinishKind,
)
from rollout_grpc.server.engines.sglang import wire
from rollout_grpc.server.engines.sglang.stream import ChunkReader

CALL = EngineCall("r", 0, [1, 2], SamplingParams(), 4, 0)


def test_every_neutral_knob_has_an_sglang_name() -> None:
    """A knob added to params.KNOBS must be given an SGLang name (or be refused) on purpose."""
    engine_names = {k.engine for k in params_mod.KNOBS if k.engine is not None}
    assert engine_names == set(wire.SAMPLING_NAMES)


def test_a_knob_without_an_sglang_name_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(params_mod, "engine_sampling_params", lambda _: {"typical_p": 0.5})
    with pytest.raises(EngineRejected) as err:
        wire.sampling_params(CALL, "u")
    assert err.value.param == "typical_p"
    assert params_mod.field_for_engine_param(err.value.param, "x") == "x"  # not silently mapped


def test_the_body_uses_sglang_names_and_always_sends_the_budget() -> None:
    sampling = SamplingParams(seed=3, no_stop_trim=False, max_new_tokens=9)
    body = wire.generate_body("u", EngineCall("i.o~r~2~", 2, [1], sampling, None, 2, top_logprobs=3))
    sp = body["sampling_params"]
    assert sp["sampling_seed"] == 3 and sp["no_stop_trim"] is False and "seed" not in sp
    assert sp["max_new_tokens"] is None and sp["min_new_tokens"] == 2
    assert body["rid"] == "i.o~r~2~" and body["top_logprobs_num"] == 3 and body["return_logprob"] is True


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("top_p must be in (0, 1], got 2.0.", "top_p"),
        ("SamplingParams.__init__() got an unexpected keyword argument 'typical_p'", "typical_p"),
        ("1 validation error: body.input_ids: Input should be a list", "prompt"),
        ("The input (9 tokens) is longer than the model's context length (4 tokens).", "prompt"),
        ("logit_bias must has keys in [0, 2047], got 9999.", "logit_bias"),
        ("max_new_tokens must be at least 0, got -1.", "max_tokens"),
        ("sampling_params.sampling_seed must be an integer, got 'x'.", "seed"),
        ("Duplicate request ID detected: r~0~", None),
    ],
)
def test_the_field_is_read_from_sglangs_message(message: str, param: str | None) -> None:
    assert wire.neutral_param(message) == param


def test_both_envelopes_and_statuses() -> None:
    flat = b'{"object":"error","message":"1 validation error: body.rid: bad","type":"Bad Request","code":400}'
    rejected = wire.http_error("u", 400, flat)
    assert isinstance(rejected, EngineRejected) and rejected.param == "rid"
    failed = wire.http_error("u", 500, b'{"error":{"message":"Internal server error"}}')
    assert isinstance(failed, EngineRequestFailed) and "Internal server error" in failed.message


def meta(n: int, total: int, **extra: object) -> dict[str, object]:
    return {
        "output_token_logprobs": [[-0.5, 10 + i, None] for i in range(total - n, total)],
        "completion_tokens": total,
        "prompt_tokens": 2,
        "finish_reason": None,
        **extra,
    }


def test_cumulative_chunks_become_deltas() -> None:
    reader = ChunkReader("u", CALL, None)
    first = reader.read({"text": "ab", "output_ids": [10, 11], "meta_info": meta(2, 2)})
    cum = meta(3, 3)
    cum["output_token_logprobs"] = [[-0.5, 10, None], [-0.5, 11, None], [-0.5, 12, None]]
    second = reader.read({"text": "abc", "output_ids": [10, 11, 12], "meta_info": cum})
    assert first == [EngineDelta([10, 11], [-0.5, -0.5], None, "ab")]
    assert second == [EngineDelta([12], [-0.5], None, "c")]


def test_incremental_chunks_pass_through_and_the_final_ends() -> None:
    reader = ChunkReader("u", CALL, None)
    reader.read({"text": "ab", "output_ids": [10, 11], "meta_info": meta(2, 2)})
    finish = {"type": "stop", "matched": 12}
    events = reader.read(
        {"text": "c", "output_ids": [12], "meta_info": meta(1, 3, finish_reason=finish, weight_version="v")}
    )
    delta, _, final = events
    assert delta == EngineDelta([12], [-0.5], None, "c")
    assert isinstance(final, EngineFinal) and final.finish is FinishKind.STOP
    assert final.stop_reason is None  # 12 is not a stop id the caller gave: EOS
    assert [(s.version, s.start, s.end) for s in final.weight_spans] == [("v", 0, 3)]


def test_a_chunk_that_adds_up_to_neither_mode_is_unusable() -> None:
    reader = ChunkReader("u", CALL, None)
    reader.read({"output_ids": [10, 11], "meta_info": meta(2, 2)})
    with pytest.raises(ValueError, match="do not make"):
        reader.read({"output_ids": [10, 11, 12, 13], "meta_info": meta(4, 5)})


def test_a_logprob_of_another_token_is_unusable() -> None:
    reader = ChunkReader("u", CALL, None)
    bad = meta(1, 1)
    bad["output_token_logprobs"] = [[-0.5, 99, None]]
    with pytest.raises(ValueError, match="does not belong"):
        reader.read({"output_ids": [10], "meta_info": bad})


def test_an_abort_with_a_server_status_is_the_engines_error() -> None:
    reader = ChunkReader("u", CALL, None)
    finish = {"type": "abort", "message": "boom", "status_code": 503, "err_type": None}
    with pytest.raises(EngineRequestFailed, match="boom"):
        reader.read({"output_ids": [], "meta_info": meta(0, 0, finish_reason=finish)})
    plain = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    *_, final = ChunkReader("u", CALL, None).read(
        {"output_ids": [], "meta_info": meta(0, 0, finish_reason=plain)}
    )
    assert isinstance(final, EngineFinal) and final.finish is FinishKind.ABORT and final.weight_spans == []
