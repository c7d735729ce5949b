"""SGLang's ``/generate`` output objects in its key order (``docs/sglang-http-api.md`` §3):
``{"text", "output_ids", "meta_info", ["prompt_token_ids"]}``, with ``meta_info`` built as
``TokenizerManager._handle_batch_output`` builds it.

Logprobs are positional ``[logprob, token_id, text|null]`` triples; finish reasons are objects
(``stop`` with ``matched``, ``length`` with ``length``, ``abort`` with ``message``); routed experts
are base64 of raw little-endian int32 ``(rows, layers, top_k)`` with no header.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sequence import Sequence, TokenLogprob
from ..vocab import EOS_ID, Vocab

#: ``_handle_abort_req``'s message for a request popped from the waiting queue (TM:3596).
QUEUED_ABORT_MESSAGE = "Abort in waiting queue"
ABORT_FINISH = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def finish_reason(seq: Sequence, length_limit: int) -> dict[str, Any] | None:
    """``BaseFinishReason.to_json()`` of the sequence's end (``None`` while it runs)."""
    r = seq.finish_reason
    if r is None:
        return None
    if r == "abort":
        return dict(ABORT_FINISH)
    if r == "length":
        return {"type": "length", "length": length_limit}
    matched = EOS_ID if seq.stop_reason is None else seq.stop_reason
    return {"type": "stop", "matched": matched}


def logprob_triples(entries: list[TokenLogprob], vocab: Vocab | None) -> list[list[Any]]:
    """``[[logprob, token_id, text|null], …]``; text only with ``return_text_in_logprobs``."""
    if vocab is None:
        return [[e.logprob, e.token_id, None] for e in entries]
    return [[e.logprob, e.token_id, vocab.token_str(e.token_id)] for e in entries]


def top_triples(entries: list[TokenLogprob], k: int, vocab: Vocab | None) -> list[list[list[Any]]]:
    """``output_top_logprobs``: per position the ``k`` best tokens, best first."""
    rows = []
    for e in entries:
        best = sorted(e.top, key=lambda t: t[2])[:k]
        rows.append([[lp, tid, vocab.token_str(tid) if vocab else None] for tid, lp, _ in best])
    return rows


def weight_version_spans(seq: Sequence, current: str) -> list[dict[str, Any]]:
    """SGLang always reports at least one span: ``[{current, 0, 0}]`` before the first token."""
    spans = seq.weight_versions()
    return spans if spans else [{"version": current, "start": 0, "end": 0}]


def encode_int32_b64(arr: np.ndarray) -> str:
    """``pybase64.b64encode(tensor.numpy().tobytes())`` of an int32 tensor: no header, no shape."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode("ascii")


@dataclass(slots=True)
class OutputSpec:
    """What one request asked to see, fixed when it starts."""

    rid: str
    prompt_ids: list[int]
    length_limit: int
    return_logprob: bool
    input_logprobs: list[Any]
    input_top_logprobs: list[Any]
    top_logprobs_num: int
    logprob_vocab: Vocab | None
    cached_tokens: int
    image_tokens: int
    prompt_token_ids: bool
    want_text: bool
    #: ``routed_experts_start_len`` when the request asked for routed experts, else ``None``.
    routed_start: int | None
    #: The request streams (incremental streaming only changes streamed outputs).
    stream: bool = False


def meta_info(
    spec: OutputSpec,
    seq: Sequence,
    *,
    version: str,
    retractions: int,
    start: int,
    routed_experts: str | None,
    e2e_latency: float | None,
) -> dict[str, Any]:
    """``meta_info`` of one output; ``start`` slices the per-token lists (incremental streaming)."""
    fin = finish_reason(seq, spec.length_limit)
    m: dict[str, Any] = {
        "id": spec.rid,
        "finish_reason": fin,
        "prompt_tokens": len(spec.prompt_ids),
        "weight_version": version,
        "num_retractions": retractions,
    }
    n = len(seq.token_ids)
    if spec.return_logprob:
        entries = seq.logprobs or []
        m["input_token_logprobs"] = spec.input_logprobs
        m["output_token_logprobs"] = logprob_triples(entries[start:], spec.logprob_vocab)
        m["output_token_logprobs_length"] = n
        if spec.top_logprobs_num > 0:
            m["input_top_logprobs"] = spec.input_top_logprobs
            m["output_top_logprobs"] = top_triples(entries[start:], spec.top_logprobs_num, spec.logprob_vocab)
    m["reasoning_tokens"] = 0
    m["completion_tokens"] = n
    m["cached_tokens"] = spec.cached_tokens
    if fin is not None:
        # The scheduler computes spans for finished requests only (0.5.23
        # managers/scheduler_components/output_streamer.py:541-554): running chunks have none.
        spans = weight_version_spans(seq, version)
        m["weight_versions"] = spans
        m["weight_version"] = spans[-1]["version"]
    if spec.image_tokens:
        m["image_tokens"] = spec.image_tokens
    if routed_experts is not None:
        m["routed_experts"] = routed_experts
    # One scheduler and no data-parallel controller: its rank is None (``SpawnRanks.dp_rank``), and
    # every batch output still carries ``dp_ranks = [None] * n`` (output_streamer.py:723), a list,
    # so SGLang 0.5.23 writes ``"dp_rank": null`` into every output it assembles (TM:2616-2617).
    m["dp_rank"] = None
    if e2e_latency is not None:
        m["e2e_latency"] = e2e_latency
    return m


def queued_abort_meta(spec: OutputSpec, seq: Sequence, *, version: str, e2e_latency: float) -> dict[str, Any]:
    """``meta_info`` of a request aborted in the waiting queue, built by the tokenizer itself
    (``_handle_abort_req``, TM:3577-3637): no ``prompt_tokens``, ``cached_tokens`` or
    ``routed_experts``; the logprob lists whole (not sliced, even when streaming incrementally)."""
    m: dict[str, Any] = {
        "id": spec.rid,
        "finish_reason": {"type": "abort", "message": QUEUED_ABORT_MESSAGE},
        "weight_version": version,
        "e2e_latency": e2e_latency,
    }
    spans = weight_version_spans(seq, version)
    m["weight_versions"] = spans
    m["weight_version"] = spans[-1]["version"]
    if spec.return_logprob:
        entries = seq.logprobs or []
        m["input_token_logprobs"] = spec.input_logprobs
        m["output_token_logprobs"] = logprob_triples(entries, spec.logprob_vocab)
        m["output_token_logprobs_length"] = len(entries)
        if spec.top_logprobs_num > 0:
            m["input_top_logprobs"] = spec.input_top_logprobs
            m["output_top_logprobs"] = top_triples(entries, spec.top_logprobs_num, spec.logprob_vocab)
    m["completion_tokens"] = len(seq.token_ids)
    return m


def output_object(
    spec: OutputSpec, text: str | None, output_ids: list[int], meta: dict[str, Any]
) -> dict[str, Any]:
    """The top-level object; without a tokenizer (``--skip-tokenizer-init``) there is no ``text``."""
    out: dict[str, Any] = {}
    if spec.want_text:
        out["text"] = text if text is not None else ""
    out["output_ids"] = output_ids
    out["meta_info"] = meta
    if spec.prompt_token_ids:
        out["prompt_token_ids"] = spec.prompt_ids
    return out
