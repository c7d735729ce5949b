"""``POST /inference/v1/generate``: validation, engine run, JSON or SSE answer, faults.

Order of checks follows vLLM: request parsing (pydantic and ``SamplingParams``), model name,
``n`` against ``max_num_seqs``, then input processing (multimodal features, vocabulary, prompt
length, logprob limits, routed-experts start). Errors never reach the engine, which is what
``SimStats.generate_started`` lets tests assert.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from . import multimodal
from .config import SimConfig
from .core import CORE_KEY, EngineCore, EngineRequest
from .errors import ApiError, bad_request, internal_error, json_response, not_found_model
from .logprobs import prompt_logprobs
from .moe import encode_npy_b64, routed_experts
from .params import SamplingParams
from .request import GenerateRequest, parse_generate, read_json_body
from .responses import (
    DONE,
    PlainChunkTemplate,
    choice_dict,
    error_event,
    nonstream_body,
    stream_chunk,
    usage,
    usage_chunk,
)
from .sequence import Sequence

SSE_CT = "text/event-stream; charset=utf-8"
MAX_LOGPROB_TOKEN_IDS = 128
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
            prepared = _prepare(core, greq)
        except ApiError as e:
            stats.generate_rejected += 1
            return e.response()
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


class _Prepared:
    __slots__ = ("extra_hash", "max_out", "mm_placeholders", "prompt_ids")

    def __init__(
        self, prompt_ids: list[int], max_out: int, mm_placeholders: dict[str, Any] | None, extra_hash: bytes
    ) -> None:
        self.prompt_ids = prompt_ids
        self.max_out = max_out
        self.mm_placeholders = mm_placeholders
        self.extra_hash = extra_hash


def _prepare(core: EngineCore, g: GenerateRequest) -> _Prepared:
    cfg = core.config
    if g.model is not None and g.model != cfg.model:
        raise not_found_model(g.model, cfg.model)
    p = g.params
    if p.n > cfg.max_num_seqs:
        raise bad_request(
            f"sampling_params.n must be at most the server's max_num_seqs ({cfg.max_num_seqs}), got {p.n}."
        )
    if cfg.tokens_only:
        if p.stop:
            raise bad_request(
                "stop strings are not supported on a --tokens-only server because detokenization is "
                "disabled. Check stop strings on the coordinator, or use stop_token_ids."
            )
        if g.output_mode != "tokens":
            raise bad_request(
                f"output_mode={g.output_mode!r} requires a tokenizer, but this server does not load one "
                "(--tokens-only or --skip-tokenizer-init). Send the request to a server that loads a "
                "tokenizer, or use output_mode='tokens'."
            )
    prompt_ids = g.token_ids
    mm_ph: dict[str, Any] | None = None
    extra = b""
    if g.features is not None or g.content_parts is not None:
        prompt_ids, mm_ph, extra = multimodal.prepare_generate(core, g)
    verify_sampling_params(cfg, p)
    plen = len(prompt_ids)
    check_prompt_len(cfg, plen)
    if prompt_ids:
        mx = max(prompt_ids)
        if mx >= cfg.vocab_size:
            raise bad_request(f"Token id {mx} is out of vocabulary")
    rs = p.routed_experts_prompt_start
    if not 0 <= rs <= plen:
        raise bad_request(
            f"routed_experts_prompt_start must be between 0 and the prompt length ({plen}), inclusive.",
            "routed_experts_prompt_start",
            rs,
            has_value=True,
        )
    room = cfg.max_model_len - plen
    max_out = room if p.max_tokens is None else min(p.max_tokens, room)
    return _Prepared(prompt_ids, max_out, mm_ph, extra)


def _out_of_vocab(ids: list[int], vocab_size: int) -> list[int]:
    return [t for t in ids if t < 0 or t >= vocab_size]


def verify_sampling_params(cfg: SimConfig, p: SamplingParams) -> None:
    """``SamplingParams.verify`` (logprob limits, token ids inside the vocabulary), in vLLM's order."""
    v = cfg.vocab_size
    max_lp = v if cfg.max_logprobs == -1 else cfg.max_logprobs
    if p.logprobs:
        k = v if p.logprobs == -1 else p.logprobs
        if k > max_lp:
            raise bad_request(
                f"Requested sample logprobs of {k}, which is greater than max allowed: {max_lp}",
                "logprobs",
                k,
                has_value=True,
            )
    if p.logprob_token_ids is not None:
        n = len(p.logprob_token_ids)
        if n > MAX_LOGPROB_TOKEN_IDS:
            raise bad_request(
                f"Requested logprob_token_ids of length {n}, which is greater than max allowed: "
                f"{MAX_LOGPROB_TOKEN_IDS}",
                "logprob_token_ids",
                n,
                has_value=True,
            )
        bad = _out_of_vocab(p.logprob_token_ids, v)
        if bad:
            raise bad_request(
                f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab token ids. "
                f"Vocabulary size: {v}",
                "logprob_token_ids",
                bad,
                has_value=True,
            )
        if p.logprobs is not None and p.logprobs != n:
            raise bad_request(
                "When both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids). Got logprobs={p.logprobs}, len(logprob_token_ids)={n}.",
                "logprob_token_ids",
                n,
                has_value=True,
            )
    if p.prompt_logprobs:
        k = v if p.prompt_logprobs == -1 else p.prompt_logprobs
        if k > max_lp:
            raise bad_request(
                f"Requested prompt logprobs of {k}, which is greater than max allowed: {max_lp}",
                "prompt_logprobs",
                k,
                has_value=True,
            )
    if p.logit_bias:
        bad = _out_of_vocab(list(p.logit_bias), v)
        if bad:
            raise bad_request(
                f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. Vocabulary size: {v}",
                "logit_bias",
                bad,
                has_value=True,
            )
    if p.stop_token_ids:
        bad = _out_of_vocab(p.stop_token_ids, v)
        if bad:
            raise bad_request(
                f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. Vocabulary size: {v}",
                "stop_token_ids",
                bad,
                has_value=True,
            )
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            raise bad_request(
                "allowed_token_ids is not None and empty!", "allowed_token_ids", [], has_value=True
            )
        bad = _out_of_vocab(p.allowed_token_ids, v)
        if bad:
            raise bad_request(
                "allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids", bad, has_value=True
            )


def check_prompt_len(cfg: SimConfig, plen: int) -> None:
    """``InputProcessor._validate_prompt_len``: the prompt must leave room for one token."""
    if cfg.multimodal:
        suggestion = (
            "Make sure that `max_model_len` is no smaller than the number of text tokens plus multimodal "
            "tokens. For image inputs, the number of image tokens depends on the number of images, and "
            "possibly their aspect ratios as well."
        )
    else:
        suggestion = "Make sure that `max_model_len` is no smaller than the number of text tokens."
    if plen > cfg.max_model_len:
        raise bad_request(
            f"The decoder prompt (length {plen}) is longer than the maximum model length of "
            f"{cfg.max_model_len}. {suggestion}"
        )
    if plen == cfg.max_model_len:
        raise bad_request(
            f"The decoder prompt (length {plen}) plus the number of requested output tokens (at least 1) "
            f"is longer than the maximum model length of {cfg.max_model_len}. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens (prompt + requested output "
            "tokens)."
        )


class _FaultPlan:
    """Faults that fire during generation, decided once when the request starts."""

    __slots__ = ("drop_after", "lp_drop", "stream_error_after")

    def __init__(self, core: EngineCore) -> None:
        f = core.config.faults
        self.stream_error_after = f.stream_error_after if f.take("stream_error") else -1
        self.drop_after = f.drop_after_tokens if f.take("drop_connection") else -1
        self.lp_drop = f.logprob_mismatch_drop if f.take("logprob_mismatch") else 0

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


async def _nonstream(
    request: web.Request,
    core: EngineCore,
    g: GenerateRequest,
    prep: _Prepared,
    ereq: EngineRequest,
    plan: _FaultPlan,
) -> web.StreamResponse:
    created = int(time.time())
    gen = core.run(ereq)
    try:
        plan.check(request, 0)
        async with contextlib.aclosing(gen):
            async for _ in gen:
                if _closed(request):
                    core.stats.disconnects += 1
                    ereq.abort()
                    continue
                plan.check(request, ereq.n_out)
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
    prep: _Prepared,
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
                    if fast and not fin and not first_chunk[0]:
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
