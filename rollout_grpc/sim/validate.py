"""Input processing for generate: the checks vLLM runs after request parsing.

They follow ``ServingTokens.serve_tokens``, ``ToySampling.verify`` and
``InputProcessor._validate_prompt_len``/``validate_token_ids`` in vLLM 0.32, with their messages, so a
rejected request never reaches the engine (``SimStats.generate_started`` stays unchanged). Errors that
vLLM's engine raises while processing the input (``in_stream=True``: out-of-vocabulary ids in the
prompt, ``stop_token_ids`` or ``logit_bias``; a prompt over ``max_model_len``; an uncached media
hash) are answered, when streaming, as HTTP 200 with one error event, as vLLM 0.32 does.
"""

from __future__ import annotations

from typing import Any

from . import multimodal
from .config import SimConfig
from .core import EngineCore
from .errors import bad_request, not_found_model
from .params import ToySampling
from .request import GenerateRequest

MAX_LOGPROB_TOKEN_IDS = 128


class Prepared:
    """The prompt as the engine sees it (multimodal placeholders expanded) and the output budget."""

    __slots__ = ("extra_hash", "max_out", "mm_placeholders", "prompt_ids")

    def __init__(
        self, prompt_ids: list[int], max_out: int, mm_placeholders: dict[str, Any] | None, extra_hash: bytes
    ) -> None:
        self.prompt_ids = prompt_ids
        self.max_out = max_out
        self.mm_placeholders = mm_placeholders
        self.extra_hash = extra_hash


def prepare_input(core: EngineCore, g: GenerateRequest) -> Prepared:
    """Engine-side checks after parsing (model, limits, multimodal input, lengths), in vLLM's order:
    ``_check_model``, ``n`` vs ``max_num_seqs``, tokens-only restrictions, multimodal processing,
    ``ToySampling.verify``, prompt length, vocabulary, routed-experts start."""
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
            raise bad_request(f"Token id {mx} is out of vocabulary", in_stream=True)
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
    return Prepared(prompt_ids, max_out, mm_ph, extra)


def _out_of_vocab(ids: list[int], vocab_size: int) -> list[int]:
    return [t for t in ids if t < 0 or t >= vocab_size]


def verify_sampling_params(cfg: SimConfig, p: ToySampling) -> None:
    """``ToySampling.verify`` (logprob limits, token ids inside the vocabulary), in vLLM's order."""
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
                in_stream=True,
            )
    if p.stop_token_ids:
        bad = _out_of_vocab(p.stop_token_ids, v)
        if bad:
            raise bad_request(
                f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. Vocabulary size: {v}",
                "stop_token_ids",
                bad,
                has_value=True,
                in_stream=True,
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
            f"{cfg.max_model_len}. {suggestion}",
            in_stream=True,
        )
    if plen == cfg.max_model_len:
        raise bad_request(
            f"The decoder prompt (length {plen}) plus the number of requested output tokens (at least 1) "
            f"is longer than the maximum model length of {cfg.max_model_len}. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens (prompt + requested output "
            "tokens).",
            in_stream=True,
        )
