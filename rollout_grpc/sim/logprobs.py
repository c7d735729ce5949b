"""``prompt_logprobs``: the toy model's scores for each prompt token (reference §3.3).

Each entry after the first (``null``) is keyed by token id as a string, the actual prompt token
first, then the top-k tokens of that position (without repeating the actual one), with
``logprob``, ``rank`` and ``decoded_token`` — what on-policy-distillation teachers read. It costs a
vocabulary pass per prompt position, so it is computed only when asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from .core import EngineCore, EngineRequest
from .model import ToyLM, clamp_logprob, context_hash, roll


def prompt_logprobs(core: EngineCore, ereq: EngineRequest) -> list[Any]:
    k_req = ereq.params.prompt_logprobs
    assert k_req is not None
    lm = core.lm
    vocab = core.vocab
    k = lm.vocab_size if k_req == -1 else k_req
    ids = ereq.prompt_ids
    out: list[Any] = [None]
    for pos, full in prompt_rows(lm, ids):
        tok = ids[pos]
        rank = int(np.count_nonzero(full > full[tok])) + 1
        entry: dict[str, Any] = {
            str(tok): {
                "logprob": clamp_logprob(float(full[tok])),
                "rank": rank,
                "decoded_token": vocab.token_str(tok),
            }
        }
        if k > 0:
            top = np.argsort(-full, kind="stable")[:k]
            for r, t in enumerate(top.tolist(), start=1):
                if str(t) not in entry:
                    entry[str(t)] = {
                        "logprob": clamp_logprob(float(full[t])),
                        "rank": r,
                        "decoded_token": vocab.token_str(t),
                    }
        out.append(entry)
    return out


def prompt_rows(lm: ToyLM, ids: list[int]) -> Iterator[tuple[int, npt.NDArray[np.float32]]]:
    """For each prompt position after the first: (position, the model's log-softmax over the
    vocabulary given the tokens before it). Shared by both personalities' prompt logprobs."""
    h = context_hash(ids[:1])
    for pos in range(1, len(ids)):
        row, eos_step = lm.step_state(h)
        yield pos, lm.full_logprobs(row, eos_step)
        h = roll(h, ids[pos])
