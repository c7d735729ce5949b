"""``POST /generate`` (and ``PUT``) as SGLang answers it: parse (``request``), prepare the prompt
(``prepare``), run the shared engine core, answer one JSON object or an SSE stream of output
objects (``output``), with the shared fault switches.

Streaming is cumulative unless ``--incremental-streaming-output``: every chunk repeats the whole
``text``, ``output_ids`` and ``output_token_logprobs`` so far, ``finish_reason`` is null until the
last chunk, and the stream ends with ``data: [DONE]``. An aborted request ends normally (HTTP 200)
with ``finish_reason.type == "abort"`` and every token generated so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import orjson
from aiohttp import web

from ..core import CORE_KEY, EngineCore, EngineRequest
from ..errors import ApiError
from ..generate import SSE_CT, _Dropped, _FaultPlan, _StreamFault, run_to_end
from ..moe import routed_experts
from ..params import ToySampling
from ..request import parse_json_bytes
from ..responses import DONE
from ..sequence import Sequence
from . import admission
from .errors import SGLangContractError, SGLangError, SGLangValidationError
from .output import OutputSpec, encode_int32_b64, meta_info, output_object, queued_abort_meta
from .prepare import Prompt, input_logprobs, prepare_prompt
from .request import SGLangRequest, parse_generate
from .state import SGLANG_KEY, SGLangState

INTERNAL_ERROR = "Internal server error"
#: `FINISH_ABORT` of a scheduler-side internal error (`status_code` 500).
ERROR_FINISH = {
    "type": "abort",
    "message": INTERNAL_ERROR,
    "status_code": 500,
    "err_type": "InternalServerError",
}


async def handle_generate(request: web.Request) -> web.StreamResponse:
    core: EngineCore = request.app[CORE_KEY]
    state: SGLangState = request.app[SGLANG_KEY]
    stats = core.stats
    faults = core.config.faults
    stats.generate_requests += 1
    core.load += 1
    core.notify()
    stream = False
    try:
        try:
            body = parse_json_bytes(await request.read())
        except ApiError:
            stats.generate_rejected += 1
            return SGLangValidationError("", "JSON decode error").response()
        stats.last_requests.append(body if isinstance(body, dict) else {"_raw": body})
        stream = isinstance(body, dict) and body.get("stream") is True
        if faults.dead:
            stats.generate_rejected += 1
            return SGLangError(INTERNAL_ERROR, 500).response()
        g = parse_generate(body, core.config.vocab_size)
        prompt = await prepare_prompt(core, g)
        if state.duplicate(g.rid):
            raise SGLangError(f"Duplicate request ID detected: {g.rid}")
        refused = admission.refusal(g, len(prompt.ids), core.config.max_model_len)
        if refused is not None:
            stats.generate_rejected += 1
            if not g.stream:
                raise SGLangError(refused)
            return await _refused_stream(request, core, state, g, prompt, refused)
        p = g.sampling.params
        if (faults.request_500_seed >= 0 and p.seed == faults.request_500_seed) or faults.take("http_500"):
            stats.generate_rejected += 1
            return SGLangError(INTERNAL_ERROR, 500).response()
        if faults.take("hang"):
            stats.hung += 1
            core.notify()
            await asyncio.Event().wait()  # until the client leaves or the engine stops
        _seed(core, p)
        spec = _spec(core, state, g, prompt)
        if g.return_logprob:
            p.logprobs = g.top_logprobs_num + 1 if g.top_logprobs_num > 0 else 0
        ereq = core.new_request(
            g.rid,
            prompt.ids,
            p,
            max_out=max(prompt.max_out, 1),
            want_text=spec.want_text,
            extra_hash=prompt.extra_hash,
        )
        if prompt.max_out == 0:
            ereq.seqs[0].finish_reason = "length"  # max_new_tokens 0: prefill only, no token
        plan = _FaultPlan(core)
        if g.stream:
            return await _stream(request, core, state, g, spec, ereq, plan)
        return await _nonstream(request, core, state, spec, ereq, plan)
    except (SGLangValidationError, SGLangContractError) as e:
        stats.generate_rejected += 1
        return e.response()
    except SGLangError as e:
        stats.generate_rejected += 1
        if stream:
            return await _error_stream(request, e)
        return e.response()
    finally:
        core.load -= 1
        core.notify()


#: The seed SGLang's deterministic mode uses when a request sets none
#: (``sampling/sampling_batch_info.py`` 157-172).
DETERMINISTIC_DEFAULT_SEED = 42


def _seed(core: EngineCore, p: ToySampling) -> None:
    """``sampling_seed`` is read only with ``--enable-deterministic-inference`` (then a request
    without one samples with 42); otherwise it is ignored and sampling is random."""
    if core.config.sglang.enable_deterministic_inference:
        p.seed = DETERMINISTIC_DEFAULT_SEED if p.seed is None else p.seed
    else:
        p.seed = None


def _spec(core: EngineCore, state: SGLangState, g: SGLangRequest, prompt: Prompt) -> OutputSpec:
    lp_vocab = core.vocab if g.return_text_in_logprobs and not core.config.tokens_only else None
    in_lp, in_top = (
        input_logprobs(core, prompt.ids, g.logprob_start_len, g.top_logprobs_num, lp_vocab)
        if g.return_logprob
        else ([], [])
    )
    return OutputSpec(
        rid=g.rid,
        prompt_ids=prompt.ids,
        length_limit=prompt.max_out,
        return_logprob=g.return_logprob,
        input_logprobs=in_lp,
        input_top_logprobs=in_top,
        top_logprobs_num=g.top_logprobs_num,
        logprob_vocab=lp_vocab,
        cached_tokens=state.cached_tokens(prompt.ids),
        image_tokens=prompt.image_tokens,
        prompt_token_ids=g.return_prompt_token_ids,
        want_text=not core.config.tokens_only,
        routed_start=g.routed_experts_start_len if g.return_routed_experts else None,
        stream=g.stream,
    )


async def _error_stream(request: web.Request, error: SGLangError) -> web.StreamResponse:
    """A ``ValueError`` once streaming was asked for: 200, one error event, ``[DONE]``."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CT})
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        await resp.write(error.event())
        await resp.write(DONE)
        await resp.write_eof()
    return resp


def _routed(core: EngineCore, spec: OutputSpec, seq: Sequence) -> str | None:
    """Rows ``[routed_experts_start_len, prompt + completion - 1)``, when both the server flag and
    the request flag are on."""
    cfg = core.config
    if spec.routed_start is None or not cfg.return_routed_experts or cfg.faults.routed_experts_unavailable:
        return None
    all_ids = spec.prompt_ids + seq.token_ids
    arr = routed_experts(
        all_ids,
        spec.routed_start,
        len(all_ids) - 1,
        num_layers=cfg.moe_layers,
        num_experts=cfg.num_experts,
        topk=cfg.moe_topk,
        seed=cfg.model_seed,
    )
    return encode_int32_b64(arr)


def _object(
    core: EngineCore,
    state: SGLangState,
    spec: OutputSpec,
    seq: Sequence,
    *,
    text: str | None,
    start: int,
    started: float,
    first: bool,
) -> bytes:
    """One output object; ``first``: the first one this request sends (it carries the send time)."""
    fin = seq.finish_reason is not None
    if fin and spec.rid in state.queued_aborts:
        out = _queued_abort(core, spec, seq, start=start, started=started)
        if first and isinstance(qmeta := out["meta_info"], dict):
            _stamp_sent(qmeta)
        return orjson.dumps(out)
    meta = meta_info(
        spec,
        seq,
        version=core.version,
        retractions=state.retractions[spec.rid],
        start=start,
        routed_experts=_routed(core, spec, seq) if fin else None,
        e2e_latency=time.monotonic() - started if fin else None,
    )
    if first:
        _stamp_sent(meta)
    return orjson.dumps(output_object(spec, text, seq.token_ids[start:], meta))


def _stamp_sent(meta: dict[str, Any]) -> None:
    """``response_sent_to_client_ts``: the wall-clock time the **first** output of a request is sent
    (the non-streaming body, or the first stream chunk), appended last; later outputs have none
    (0.5.23 ``_stream_one_response``, TM:1946, 2025-2029, 2055-2059: set once per request)."""
    meta["response_sent_to_client_ts"] = time.time()


def _queued_abort(
    core: EngineCore, spec: OutputSpec, seq: Sequence, *, start: int, started: float
) -> dict[str, object]:
    """The tokenizer's own output for a request popped from the waiting queue
    (``_handle_abort_req``, TM:3577-3640): the full text, the reduced ``meta_info`` with every
    logprob since the start, and in incremental streaming (``start > 0`` or the option) only the
    **last** token id while ``completion_tokens`` counts all of them."""
    incremental = core.config.sglang.incremental_streaming_output and spec.stream
    ids = seq.token_ids
    out_ids = ids[-1:] if incremental else list(ids)
    meta = queued_abort_meta(spec, seq, version=core.version, e2e_latency=time.monotonic() - started)
    out: dict[str, object] = {}
    if spec.want_text:
        out["text"] = seq.text
    out["output_ids"] = out_ids
    out["meta_info"] = meta
    if spec.prompt_token_ids:
        out["prompt_token_ids"] = spec.prompt_ids
    return out


def _error_frame(
    core: EngineCore,
    state: SGLangState,
    spec: OutputSpec,
    seq: Sequence,
    *,
    incremental: bool,
    start: int,
    first: bool,
) -> bytes:
    """The final stream chunk of a request the scheduler ended with an internal error."""
    begin = start if incremental else 0
    meta = meta_info(
        spec,
        seq,
        version=core.version,
        retractions=state.retractions[spec.rid],
        start=begin,
        routed_experts=None,
        e2e_latency=None,
    )
    meta["finish_reason"] = dict(ERROR_FINISH)
    if first:
        _stamp_sent(meta)
    text = (seq.take_text_delta() if incremental else seq.text) if spec.want_text else None
    return b"data: " + orjson.dumps(output_object(spec, text, seq.token_ids[begin:], meta)) + b"\n\n"


async def _refused_stream(
    request: web.Request, core: EngineCore, state: SGLangState, g: SGLangRequest, prompt: Prompt, why: str
) -> web.StreamResponse:
    """A streaming request the scheduler refuses (``admission.refusal``): its one-token stub takes
    one forward pass, and the stream's only chunk ends it with the 400 abort, then ``[DONE]``
    (TM 1922, 2042-2048). ``prompt_tokens`` is the stub's 1; no logprobs, cache or routing."""
    spec = _spec(core, state, g, prompt)
    stub = dataclasses.replace(
        spec,
        prompt_ids=list(admission.STUB_PROMPT),
        length_limit=1,
        return_logprob=False,
        cached_tokens=0,
        image_tokens=0,
        prompt_token_ids=False,
        routed_start=None,
    )
    _seed(core, g.sampling.params)
    ereq = core.new_request(g.rid, stub.prompt_ids, g.sampling.params, max_out=1, want_text=spec.want_text)
    resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CT})
    await resp.prepare(request)
    started = time.monotonic()
    gen = core.run(ereq)
    try:
        async with contextlib.aclosing(gen):
            async for _ in gen:
                pass
    except (ConnectionError, asyncio.CancelledError):
        core.stats.disconnects += 1
        raise
    finally:
        state.forget(g.rid)
    seq = ereq.seqs[0]
    meta = meta_info(
        stub,
        seq,
        version=core.version,
        retractions=0,
        start=0,
        routed_experts=None,
        e2e_latency=time.monotonic() - started,
    )
    meta["finish_reason"] = admission.refused_finish(why)
    _stamp_sent(meta)
    out = output_object(stub, seq.text if spec.want_text else None, seq.token_ids, meta)
    if spec.prompt_token_ids:
        out["prompt_token_ids"] = spec.prompt_ids  # the tokenizer's own state keeps the real prompt
    with contextlib.suppress(ConnectionError):
        await resp.write(b"data: " + orjson.dumps(out) + b"\n\n")
        await resp.write(DONE)
        await resp.write_eof()
    return resp


def _finish(state: SGLangState, spec: OutputSpec, ereq: EngineRequest) -> None:
    state.forget(spec.rid)
    state.remember(spec.prompt_ids + ereq.seqs[0].token_ids)


async def _nonstream(
    request: web.Request,
    core: EngineCore,
    state: SGLangState,
    spec: OutputSpec,
    ereq: EngineRequest,
    plan: _FaultPlan,
) -> web.StreamResponse:
    started = time.monotonic()
    try:
        await run_to_end(request, core, ereq, plan)
        seq = ereq.seqs[0]
        body = _object(core, state, spec, seq, text=seq.text, start=0, started=started, first=True)
    except _Dropped:
        return web.Response(status=200)
    except _StreamFault:
        return SGLangError(INTERNAL_ERROR, 500).response()
    except asyncio.CancelledError:
        core.stats.disconnects += 1
        raise
    finally:
        _finish(state, spec, ereq)
    return web.Response(body=body, content_type="application/json")


async def _stream(
    request: web.Request,
    core: EngineCore,
    state: SGLangState,
    g: SGLangRequest,
    spec: OutputSpec,
    ereq: EngineRequest,
    plan: _FaultPlan,
) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CT})
    await resp.prepare(request)
    opts = core.config.sglang
    incremental = opts.incremental_streaming_output
    interval = g.sampling.params.stream_interval or opts.stream_interval
    seq = ereq.seqs[0]
    sent = 0
    chunks = 0
    started = time.monotonic()
    gen = core.run(ereq)
    try:
        plan.check(request, 0)
        async with contextlib.aclosing(gen):
            async for _ in gen:
                n = len(seq.token_ids)
                if seq.finish_reason is None and (n == sent or (sent and n - sent < interval)):
                    continue
                if incremental:
                    text = seq.take_text_delta() if spec.want_text else None
                    obj = _object(
                        core, state, spec, seq, text=text, start=sent, started=started, first=not chunks
                    )
                else:
                    obj = _object(
                        core, state, spec, seq, text=seq.text, start=0, started=started, first=not chunks
                    )
                await resp.write(b"data: " + obj + b"\n\n")
                sent = n
                chunks += 1
                plan.check(request, n)
            await resp.write(DONE)
    except _Dropped:
        return resp
    except _StreamFault:
        # A scheduler-side error after the stream opened is the final output itself, an abort with
        # the error's status (docs/sglang-http-api.md §3.1, §7), then [DONE].
        with contextlib.suppress(ConnectionError):
            frame = _error_frame(
                core, state, spec, seq, incremental=incremental, start=sent, first=not chunks
            )
            await resp.write(frame)
            await resp.write(DONE)
        return resp
    except (ConnectionError, asyncio.CancelledError):
        core.stats.disconnects += 1
        raise
    finally:
        _finish(state, spec, ereq)
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp
