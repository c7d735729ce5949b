"""``POST /inference/v1/generate``: parse (``request``), check (``validate``), run the engine
(``core``), answer as JSON or SSE (``responses``), and inject faults mid-answer.

Every rejected request is answered before entering the engine, which is what
``SimStats.generate_started`` lets tests assert ("no engine request was made").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
from aiohttp import web

from . import multimodal
from .core import CORE_KEY, EngineCore, EngineRequest
from .errors import ApiError, internal_error, json_response
from .logprobs import prompt_logprobs
from .moe import encode_npy_b64, routed_experts
from .request import GenerateRequest, parse_generate, read_json_body
from .responses import (
    DONE,
    PlainChunkTemplate,
    choice_dict,
    error_event,
    nonstream_body,
    sse,
    stream_chunk,
    usage,
    usage_chunk,
)
from .sequence import Sequence
from .validate import Prepared, prepare_input

SSE_CT = "text/event-stream; charset=utf-8"
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class _Dropped(Exception):
    """The drop-connection fault fired; the transport is already closed."""


class _StreamFault(Exception):
    """The mid-stream error fault fired."""


async def handle_generate(request: web.Request) -> web.StreamResponse:
    core: EngineCore = request.app[CORE_KEY]
    stats = core.stats
    faults = core.config.faults
    stats.generate_requests += 1
    core.load += 1
    core.notify()
    try:
        try:
            body = await read_json_body(request)
        except ApiError as e:
            stats.generate_rejected += 1
            return e.response()
        stats.last_requests.append(body if isinstance(body, dict) else {"_raw": body})
        if faults.dead:
            stats.generate_rejected += 1
            return ApiError(500, ENGINE_DEAD_MESSAGE, "InternalServerError").response()
        try:
            greq = parse_generate(body, request.headers.get("X-Request-Id"))
            if greq.content_parts and greq.features is None:
                greq.media = await multimodal.fetch_content_parts(core, greq.content_parts)
            prepared = prepare_input(core, greq)
        except ApiError as e:
            stats.generate_rejected += 1
            if e.in_stream and greq.stream:
                return await _error_stream(request, e)
            return e.response()
        except multimodal.UndecodableKwargs:
            stats.generate_rejected += 1
            return web.Response(status=500, text="Internal Server Error", headers={"Connection": "close"})
        if faults.request_500_seed >= 0 and greq.params.seed == faults.request_500_seed:
            stats.generate_rejected += 1
            return internal_error().response()
        if faults.take("http_500"):
            stats.generate_rejected += 1
            return internal_error().response()
        if faults.take("hang"):
            stats.hung += 1
            core.notify()
            await asyncio.Event().wait()  # until the client leaves or the engine stops
        ereq = core.new_request(
            greq.request_id,
            prepared.prompt_ids,
            greq.params,
            max_out=prepared.max_out,
            want_text=greq.output_mode == "text",
            extra_hash=prepared.extra_hash,
        )
        plan = _FaultPlan(core)
        if greq.stream:
            return await _stream(request, core, greq, prepared, ereq, plan)
        return await _nonstream(request, core, greq, prepared, ereq, plan)
    finally:
        core.load -= 1
        core.notify()


async def _error_stream(request: web.Request, error: ApiError) -> web.StreamResponse:
    """What vLLM answers a streaming request its engine rejects: 200, one error event, [DONE]."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CT})
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        await resp.write(error_event(error.body()))
        await resp.write(DONE)
        await resp.write_eof()
    return resp


#: Padding of the ``huge_line`` malformed kind: 1 MiB of JSON whitespace.
HUGE_LINE_PAD = b" " * (1 << 20)


def _malformed_chunk(kind: str, chunk: dict[str, Any]) -> bytes:
    """``chunk`` (one stream chunk object) broken the way the ``malformed`` fault's kind says."""
    choice = chunk["choices"][0]
    if kind == "invalid_json":
        return b'data: {"request_id": "' + str(chunk["request_id"]).encode() + b'", "choices": [\n\n'
    if kind == "array_chunk":
        return sse(choice["token_ids"])
    if kind == "huge_line":
        return b"data: {" + HUGE_LINE_PAD + orjson.dumps(chunk)[1:] + b"\n\n"
    if kind == "missing_logprob":
        entries = (choice.get("logprobs") or {}).get("content") or [{} for _ in choice["token_ids"]]
        choice["logprobs"] = {"content": [{k: v for k, v in e.items() if k != "logprob"} for e in entries]}
    elif kind == "string_token_ids":
        choice["token_ids"] = [str(t) for t in choice["token_ids"]]
    elif kind == "negative_token_ids":
        choice["token_ids"] = [-1 - t for t in choice["token_ids"]]
    elif kind == "bad_weight_spans":
        choice["weight_versions"] = [{"version": "v", "start": "0", "end": 1.5}]
    return sse(chunk)


class _FaultPlan:
    """Faults that fire during generation, decided once when the request starts."""

    __slots__ = ("drop_after", "lp_drop", "malformed_after", "malformed_kind", "stream_error_after")

    def __init__(self, core: EngineCore) -> None:
        f = core.config.faults
        self.stream_error_after = f.stream_error_after if f.take("stream_error") else -1
        self.drop_after = f.drop_after_tokens if f.take("drop_connection") else -1
        self.lp_drop = f.logprob_mismatch_drop if f.take("logprob_mismatch") else 0
        self.malformed_after = f.malformed_after if f.take("malformed") else -1
        self.malformed_kind = f.malformed_kind

    def malformed_now(self, index: int, sent: int, final: bool) -> bool:
        """True (once) when this chunk of choice `index`, after `sent` tokens, is to be broken."""
        if index != 0 or self.malformed_after < 0:
            return False
        if self.malformed_kind == "bad_weight_spans" and not final:
            return False
        if self.malformed_kind != "bad_weight_spans" and sent < self.malformed_after:
            return False
        self.malformed_after = -1
        return True

    def check(self, request: web.Request, n_tokens: int) -> None:
        if 0 <= self.drop_after <= n_tokens:
            if request.transport is not None:
                request.transport.abort()
            raise _Dropped
        if 0 <= self.stream_error_after <= n_tokens:
            raise _StreamFault


def _routed(core: EngineCore, ereq: EngineRequest, seq: Sequence) -> str | None:
    cfg = core.config
    if not cfg.return_routed_experts or cfg.faults.routed_experts_unavailable:
        return None
    n_out = len(seq.token_ids)
    if n_out == 0:
        return None
    prompt = ereq.prompt_ids
    start = ereq.params.routed_experts_prompt_start
    arr = routed_experts(
        prompt + seq.token_ids,
        start,
        len(prompt) + n_out - 1,
        num_layers=cfg.moe_layers,
        num_experts=cfg.num_experts,
        topk=cfg.moe_topk,
        seed=cfg.model_seed,
    )
    return encode_npy_b64(arr)


def _closed(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


async def run_to_end(request: web.Request, core: EngineCore, ereq: EngineRequest, plan: _FaultPlan) -> None:
    """Drive a non-streaming request to its end (both personalities): a client that went away
    aborts it, and the planned faults fire (``_Dropped``, ``_StreamFault``)."""
    gen = core.run(ereq)
    plan.check(request, 0)
    async with contextlib.aclosing(gen):
        async for _ in gen:
            if _closed(request):
                core.stats.disconnects += 1
                ereq.abort()
                continue
            plan.check(request, ereq.n_out)


async def _nonstream(
    request: web.Request,
    core: EngineCore,
    g: GenerateRequest,
    prep: Prepared,
    ereq: EngineRequest,
    plan: _FaultPlan,
) -> web.StreamResponse:
    created = int(time.time())
    try:
        await run_to_end(request, core, ereq, plan)
    except _Dropped:
        return web.Response(status=200)
    except _StreamFault:
        return internal_error().response()
    except asyncio.CancelledError:
        core.stats.disconnects += 1
        raise
    text_mode = g.output_mode == "text"
    vocab = core.vocab
    choices = []
    total = 0
    for s in ereq.seqs:
        entries = s.logprobs
        if entries is not None and plan.lp_drop:
            entries = entries[: max(0, len(entries) - plan.lp_drop)]
        choices.append(
            choice_dict(
                s,
                token_ids=s.token_ids,
                logprob_entries=entries,
                final=True,
                routed_experts=_routed(core, ereq, s),
                text=s.text if text_mode else None,
                vocab=vocab,
                nonstream=True,
            )
        )
        total += len(s.token_ids)
    prompt_lp = prompt_logprobs(core, ereq) if g.params.prompt_logprobs is not None else None
    body = nonstream_body(
        request_id=g.request_id,
        model=core.config.model,
        created=created,
        prompt_len=len(prep.prompt_ids),
        prompt_token_ids=prep.prompt_ids if g.return_token_ids else None,
        mm_placeholders=prep.mm_placeholders if g.return_token_ids else None,
        prompt_logprobs=prompt_lp,
        output_mode=g.output_mode,
        choices=choices,
        completion_tokens=total,
    )
    return json_response(body)


async def _stream(
    request: web.Request,
    core: EngineCore,
    g: GenerateRequest,
    prep: Prepared,
    ereq: EngineRequest,
    plan: _FaultPlan,
) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CT})
    await resp.prepare(request)
    rid = g.request_id
    text_mode = g.output_mode == "text"
    want_lp = g.params.logprobs is not None
    plen = len(prep.prompt_ids)
    fast = not text_mode and not want_lp and not g.continuous_usage
    templates = [PlainChunkTemplate(rid, s.index) for s in ereq.seqs] if fast else []
    sent = [0] * len(ereq.seqs)
    final_sent = [False] * len(ereq.seqs)
    first_chunk = [g.return_token_ids]  # prompt ids go in the very first chunk only
    vocab = core.vocab
    interval = g.params.stream_interval or 1
    gen = core.run(ereq)
    try:
        plan.check(request, 0)
        async with contextlib.aclosing(gen):
            async for _ in gen:
                for s in ereq.seqs:
                    i = s.index
                    if final_sent[i]:
                        continue
                    n = len(s.token_ids)
                    fin = s.finish_reason is not None
                    if not fin and (n == sent[i] or (sent[i] and n - sent[i] < interval)):
                        continue  # stream_interval: first and final outputs are never delayed
                    delta = s.token_ids[sent[i] : n]
                    malformed = plan.malformed_now(i, sent[i], fin)
                    if fast and not fin and not first_chunk[0] and not malformed:
                        chunk = templates[i].render(delta)
                    else:
                        entries = s.logprobs[sent[i] : n] if s.logprobs is not None else None
                        if fin and entries is not None and plan.lp_drop:
                            entries = entries[: max(0, len(entries) - plan.lp_drop)]
                        choice = choice_dict(
                            s,
                            token_ids=delta,
                            logprob_entries=entries,
                            final=fin,
                            routed_experts=_routed(core, ereq, s) if fin else None,
                            text=s.take_text_delta() if text_mode else None,
                            vocab=vocab,
                            nonstream=False,
                        )
                        with_ids = first_chunk[0]
                        first_chunk[0] = False
                        chunk = stream_chunk(
                            request_id=rid,
                            usage_obj=usage(plen, n) if g.continuous_usage else None,
                            prompt_token_ids=prep.prompt_ids if with_ids else None,
                            mm_placeholders=prep.mm_placeholders if with_ids else None,
                            output_mode=g.output_mode,
                            choice=choice,
                        )
                        if malformed:
                            chunk = _malformed_chunk(plan.malformed_kind, orjson.loads(chunk[6:]))
                    sent[i] = n
                    if fin:
                        final_sent[i] = True
                    await resp.write(chunk)
                    if i == 0:
                        plan.check(request, n)
            if g.include_usage:
                total = sum(len(s.token_ids) for s in ereq.seqs)
                await resp.write(usage_chunk(rid, plen, total, g.output_mode))
            await resp.write(DONE)
    except _Dropped:
        return resp
    except _StreamFault:
        with contextlib.suppress(ConnectionError):
            await resp.write(error_event())
            await resp.write(DONE)
        return resp
    except (ConnectionError, asyncio.CancelledError):
        core.stats.disconnects += 1
        raise
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp
