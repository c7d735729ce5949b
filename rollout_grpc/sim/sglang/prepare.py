"""From a parsed ``/generate`` call to the prompt the engine runs: tokenisation, images, the
``TokenizerManager`` checks (vocabulary, context length, the budget) and the prompt
logprobs asked for with ``logprob_start_len`` (``docs/sglang-http-api.md`` §2, §9).

With images, the ids are decoded and tokenized again first (``retokenize``), unless the server
models a processor that keeps them (``SGLangOptions.processor_keeps_input_ids``: kimi_k25,
kimi_k3, deepseek_v41, or Qwen-VL's cached fast path). Images then take the toy path of the vLLM
personality's ``content_parts``: each image replaces the
next single ``<|image_pad|>`` of the prompt with its placeholder run, so the output depends on the
image; SGLang's processor does the same expansion on the chat-templated text slime sends.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import multimodal
from ..core import EngineCore
from ..errors import ApiError
from ..logprobs import prompt_rows
from ..vocab import IMAGE_PAD_ID, Vocab
from . import admission
from .errors import SGLangError
from .request import SGLangRequest


def retokenize(vocab: Vocab, ids: list[int]) -> list[int]:
    """What SGLang's multimodal processors do with ``input_ids`` unless they set
    ``prefer_tokenized_input``: the ids are the processor's "text", which
    ``BaseMultimodalProcessor.load_mm_data`` decodes to a string and tokenizes again
    (``managers/tokenizer_manager.py`` 1177-1182, ``multimodal/processors/base_processor.py``
    1293-1309). A non-canonical split of the same text comes back canonical: other ids."""
    return vocab.encode(vocab.decode(ids))


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    max_out: int
    image_tokens: int
    extra_hash: bytes


async def _image_bytes(item: str) -> bytes:
    """A URL (``data:``, ``http(s):``) through the shared fetcher, else bare base64."""
    if item.startswith(("data:", "http://", "https://")):
        return await multimodal.fetch_media(item)
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise SGLangError(f"Invalid image data: not a URL, path or base64 string ({item[:32]!r}).") from None


async def prepare_prompt(core: EngineCore, g: SGLangRequest) -> Prompt:
    cfg = core.config
    if g.input_ids is not None:
        ids = list(g.input_ids)
    else:
        if cfg.tokens_only:
            raise SGLangError("text input requires a tokenizer; this server runs with --skip-tokenizer-init.")
        ids = core.vocab.encode(g.text or "")
        if not ids:
            raise SGLangError("input_ids cannot be empty.")
    if g.sampling.params.stop and cfg.tokens_only:
        raise SGLangError("stop strings need a tokenizer; this server runs with --skip-tokenizer-init.")
    extra = b""
    image_tokens = 0
    if g.image_data:
        if not cfg.multimodal:
            raise SGLangError(f"{cfg.model} does not take image input (not a multimodal model).")
        if len(g.image_data) > cfg.limit_images:
            raise SGLangError(
                f"Image count {len(g.image_data)} exceeds limit {cfg.limit_images} per request."
            )
        if g.input_ids is not None and not cfg.sglang.processor_keeps_input_ids:
            ids = retokenize(core.vocab, ids)
        try:
            media = [await _image_bytes(i) for i in g.image_data]
            pads = ids.count(IMAGE_PAD_ID)
            if pads < len(media):
                raise SGLangError(
                    f"The prompt has {pads} image placeholder(s) for {len(media)} image(s) in image_data."
                )
            ids, ranges, extra = multimodal.expand_media(core, ids, media)
        except ApiError as e:
            raise SGLangError(e.message) from None
        image_tokens = sum(r["length"] for r in ranges["image"])
    if max(ids) >= cfg.vocab_size or min(ids) < 0:
        raise SGLangError(
            f"The input_ids {ids} contains values greater than the vocab size ({cfg.vocab_size})."
        )
    ctx = cfg.max_model_len
    if len(ids) >= ctx:
        raise SGLangError(
            f"The input ({len(ids)} tokens) is longer than the model's context length ({ctx} tokens)."
        )
    room = ctx - len(ids)
    max_new = g.sampling.max_new_tokens
    if max_new is not None and max_new > room:
        # validate_total_tokens (0.5.23 managers/tokenizer_manager.py:1353-1378): refused, not cut.
        raise SGLangError(
            "Requested token count exceeds the model's maximum context length "
            f"of {ctx} tokens. You requested a total of {len(ids) + max_new} "
            f"tokens: {len(ids)} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )
    # The scheduler's cap (admission.budget): two tokens short of the context.
    return Prompt(ids, admission.budget(max_new, len(ids), ctx), image_tokens, extra)


def input_logprobs(
    core: EngineCore, ids: list[int], start: int, top_k: int, vocab: Vocab | None
) -> tuple[list[Any], list[Any]]:
    """``input_token_logprobs`` and ``input_top_logprobs`` from prompt position ``start`` on (``-1``:
    none). Position 0 has no logprob (``null``), as in SGLang."""
    if start < 0:
        return [], []

    def text(t: int) -> str | None:
        return vocab.token_str(t) if vocab is not None else None

    tokens: list[Any] = [[None, ids[0], text(ids[0])]] if start == 0 else []
    tops: list[Any] = [None] if start == 0 else []
    for pos, full in prompt_rows(core.lm, ids):
        if pos < start:
            continue
        tokens.append([float(full[ids[pos]]), ids[pos], text(ids[pos])])
        if top_k > 0:
            best = np.argsort(-full, kind="stable")[:top_k].tolist()
            tops.append([[float(full[t]), t, text(t)] for t in best])
    return tokens, tops
