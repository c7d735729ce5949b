"""Deterministic toy language model: context hash -> one of K precomputed next-token distributions.

Why this shape:
* **Deterministic and context-dependent.** The state is a rolling 64-bit hash over every token of
  the context (prompt and output alike), so the next-token distribution depends on the whole
  sequence and on nothing else. A continuation that re-sends ``prompt + partial output`` as its
  prompt therefore sees exactly the distributions the original request saw: greedy decoding
  continues with the same tokens, as it would on a real model.
* **True softmax logprobs, cheap.** K rows of logits (float32, like vLLM's sampler) are drawn once
  per (vocab_size, seed) and stored as log-softmax values with their argsort, so the common cases
  (greedy; temperature 1 without filters) cost a table lookup per token. Tables are shared by all
  engines in the process.
* **EOS is reachable.** With probability ``eos_probability`` per step (decided by the hash, so
  still deterministic) the step is an "EOS step" whose distribution puts most mass on
  ``<|im_end|>``; otherwise EOS and the other special tokens get very low logits. Setting the
  probability to 0 makes outputs run to ``max_tokens``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import numpy.typing as npt

from .vocab import EOS_ID, NUM_SPECIAL

MASK64 = (1 << 64) - 1
_MUL = 0x100000001B3  # FNV-1a 64-bit prime; any odd constant works for the rolling hash
_ROOT = 0xCBF29CE484222325
NUM_ROWS = 1024
EOS_STEP_BOOST = 6.0  # EOS logit above the row maximum on an EOS step (p(EOS) ~ 0.9)
_U32 = float(1 << 32)

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int32]


def mix64(h: int) -> int:
    """splitmix64 finaliser: spreads the rolling hash so row choice and EOS flag look random."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & MASK64
    return h ^ (h >> 31)


def roll(h: int, token_id: int) -> int:
    """Rolling context hash after appending ``token_id``."""
    return (h * _MUL + token_id + 1) & MASK64


def context_hash(token_ids: list[int]) -> int:
    """Hash of a whole context, equal to rolling ``roll`` over each id from the root."""
    h = _ROOT
    for t in token_ids:
        h = (h * _MUL + t + 1) & MASK64
    return h


class Tables:
    """Precomputed distributions ([NUM_ROWS, vocab], float32 like vLLM's sampler).

    Per-row sort orders and CDFs are built on first use (tens of microseconds each) so that
    creating the tables stays cheap; a process touches at most NUM_ROWS of each.
    """

    __slots__ = ("_cdf", "_order", "eos_logprob", "eos_step_logprob", "logprobs", "lse_shift_eos", "top_id")

    def __init__(
        self,
        logprobs: FloatArray,
        lse_shift_eos: FloatArray,
        eos_step_logprob: FloatArray,
    ) -> None:
        self.logprobs = logprobs  # log-softmax of each row's logits
        self.top_id: IntArray = np.argmax(logprobs, axis=1).astype(np.int32)
        self.eos_logprob: FloatArray = np.ascontiguousarray(logprobs[:, EOS_ID])
        self.lse_shift_eos = lse_shift_eos  # EOS step: log-normaliser increase
        self.eos_step_logprob = eos_step_logprob  # EOS step: EOS logprob
        self._order: list[IntArray | None] = [None] * logprobs.shape[0]
        self._cdf: list[npt.NDArray[np.float64] | None] = [None] * logprobs.shape[0]

    def order(self, row: int) -> IntArray:
        """Token ids of ``row`` by descending logprob (stable for ties)."""
        o = self._order[row]
        if o is None:
            o = np.argsort(-self.logprobs[row], kind="stable").astype(np.int32)
            self._order[row] = o
        return o

    def cdf(self, row: int) -> npt.NDArray[np.float64]:
        """Cumulative probabilities of ``row`` (temperature 1), normalised to end at 1."""
        c = self._cdf[row]
        if c is None:
            c = np.cumsum(np.exp(self.logprobs[row].astype(np.float64)))
            c /= c[-1]
            self._cdf[row] = c
        return c


@functools.lru_cache(maxsize=4)
def get_tables(vocab_size: int, seed: int) -> Tables:
    """Draw and normalise the K rows once per (vocab_size, seed); ~50 ms for 2048 tokens."""
    rng = np.random.Generator(np.random.PCG64(seed ^ 0x5EED))
    logits = rng.standard_normal((NUM_ROWS, vocab_size), dtype=np.float32) * np.float32(1.3)
    # A few "favourite" tokens per row make the distributions peaky like a real small model.
    fav = rng.integers(NUM_SPECIAL, vocab_size, size=(NUM_ROWS, 8))
    boost = rng.uniform(1.0, 3.0, size=(NUM_ROWS, 8)).astype(np.float32)
    np.add.at(logits, (np.arange(NUM_ROWS)[:, None], fav), boost)
    logits[:, :NUM_SPECIAL] = np.float32(-6.0)  # specials (incl. EOS) are rare outside EOS steps
    mx = logits.max(axis=1, keepdims=True)
    lse = mx + np.log(np.exp(logits - mx).sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
    logprobs = (logits - lse).astype(np.float32)
    # EOS step: EOS logit becomes row max + boost; renormalise analytically.
    eos_logit = mx[:, 0] + np.float32(EOS_STEP_BOOST)
    old_eos = logits[:, EOS_ID]
    lse0 = lse[:, 0].astype(np.float64)
    new_sum = np.exp(lse0) - np.exp(old_eos.astype(np.float64)) + np.exp(eos_logit.astype(np.float64))
    lse1 = np.log(new_sum)
    logprobs.setflags(write=False)
    return Tables(logprobs, (lse1 - lse0).astype(np.float32), (eos_logit - lse1).astype(np.float32))


class ToyLM:
    """The model: maps a context hash to (row, is_eos_step)."""

    def __init__(self, vocab_size: int, seed: int, eos_probability: float) -> None:
        self.vocab_size = vocab_size
        self.tables = get_tables(vocab_size, seed)
        self.set_eos_probability(eos_probability)

    def set_eos_probability(self, p: float) -> None:
        self.eos_probability = p
        self._eos_threshold = int(max(0.0, min(1.0, p)) * _U32)

    def step_state(self, h: int) -> tuple[int, bool]:
        """Row index and whether this context is an EOS step."""
        m = mix64(h)
        return m % NUM_ROWS, ((m >> 32) & 0xFFFFFFFF) < self._eos_threshold

    def full_logprobs(self, row: int, eos_step: bool) -> FloatArray:
        """The raw (pre-processing) log-softmax over the vocabulary for one step."""
        t = self.tables
        if not eos_step:
            out: FloatArray = t.logprobs[row]
            return out
        lp: FloatArray = (t.logprobs[row] - t.lse_shift_eos[row]).astype(np.float32)
        lp[EOS_ID] = t.eos_step_logprob[row]
        return lp


def clamp_logprob(x: float) -> float:
    """vLLM clamps -inf/NaN/very negative logprobs to -9999.0."""
    if math.isnan(x) or x < -9999.0:
        return -9999.0
    return x
