"""One output sequence (a ``choice``): sampling, stop checks, text and weight-version spans.

Sampling follows vLLM's v1 sampler order: raw logprobs are recorded first (the default
``--logprobs-mode raw_logprobs``), then allowed-ids, bad words, logit bias, min-tokens masking and
penalties, then temperature, top-k, top-p and min-p. Stop checks follow
``vllm/v1/core/sched/utils.py::check_stop`` (EOS, stop ids, then length) and stop strings are
checked on the detokenized text afterwards, overriding a length finish like vLLM's output
processor does.
"""

from __future__ import annotations

import numpy as np

from .model import ToyLM, roll
from .params import ToySampling
from .vocab import EOS_ID, IncrementalDecoder, Vocab

_NEG_INF = np.float32(-np.inf)
_RAND_BLOCK = 256


class VersionRef:
    """The engine's current weight version, shared by all sequences (read once per token)."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value


class TokenLogprob:
    """Logprob data for one generated token (raw logprobs; top entries sampled-first)."""

    __slots__ = ("logprob", "rank", "token_id", "top")

    def __init__(self, token_id: int, logprob: float, rank: int, top: list[tuple[int, float, int]]) -> None:
        self.token_id = token_id
        self.logprob = logprob
        self.rank = rank
        self.top = top


class Sequence:
    """Generation state of one choice. ``step()`` is the per-token hot path."""

    def __init__(
        self,
        index: int,
        *,
        lm: ToyLM,
        vocab: Vocab,
        params: ToySampling,
        prompt_ids: list[int],
        prompt_hash: int,
        max_out: int,
        rng_seed: int,
        version: VersionRef,
        want_text: bool,
    ) -> None:
        self.index = index
        self.lm = lm
        self.vocab = vocab
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.max_out = max_out
        self.h = prompt_hash
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # weight_versions: (version, first output position), a new entry whenever a token is
        # generated under a different engine weight version (vLLM's track_weight_version).
        self._version = version
        self.spans: list[tuple[str, int]] = []
        self._rng = np.random.Generator(np.random.PCG64(rng_seed))
        self._rand = self._rng.random(_RAND_BLOCK)
        self._rand_i = 0
        self._k = (
            0 if params.logprobs is None else (lm.vocab_size if params.logprobs == -1 else params.logprobs)
        )
        self._simple = not (
            params.logit_bias
            or params.allowed_token_ids
            or params.bad_words
            or params.presence_penalty
            or params.frequency_penalty
            or params.repetition_penalty != 1.0
        )
        self._plain_t1 = (
            params.temperature == 1.0 and params.top_p == 1.0 and params.top_k <= 0 and params.min_p == 0.0
        )
        self._stop_ids = set(params.stop_token_ids)
        self._min_mask_ids = sorted({EOS_ID, *self._stop_ids} & set(range(lm.vocab_size)))
        self._counts: dict[int, int] | None = (
            {} if (params.presence_penalty or params.frequency_penalty) else None
        )
        self._seen: set[int] | None = set(prompt_ids) if params.repetition_penalty != 1.0 else None
        self._bad: list[list[int]] = []
        for w in params.bad_words:
            for prefix in ("", " "):
                ids = vocab.encode(prefix + w.lstrip())
                if ids and ids not in self._bad:
                    self._bad.append(ids)
        # Text is needed for output_mode "text" and for stop strings.
        self.track_text = want_text or bool(params.stop)
        self.decoder = IncrementalDecoder(vocab, skip_special_tokens=params.skip_special_tokens)
        self.text_cut: int | None = None  # final text length after a stop-string cut
        self.emitted_text = 0  # chars of text already sent (streaming)
        self._max_stop = max((len(s) for s in params.stop), default=0)

    # ------------------------------------------------------------------ sampling
    def _uniform(self) -> float:
        i = self._rand_i
        if i >= _RAND_BLOCK:
            self._rand = self._rng.random(_RAND_BLOCK)
            i = 0
        self._rand_i = i + 1
        return float(self._rand[i])

    def step(self) -> int:
        """Generate one token, update state, and return it (the caller checks ``finished``)."""
        lm = self.lm
        t = lm.tables
        row, eos_step = lm.step_state(self.h)
        p = self.params
        n_out = len(self.token_ids)
        min_active = n_out < p.min_tokens
        token: int
        if self._simple and not min_active and not eos_step and (p.greedy or self._plain_t1):
            token = (
                int(t.top_id[row]) if p.greedy else int(np.searchsorted(t.cdf(row), self._uniform(), "right"))
            )
            if token >= lm.vocab_size:
                token = lm.vocab_size - 1
            raw = None
        elif self._simple and not min_active and eos_step and p.greedy:
            token = EOS_ID
            raw = None
        else:
            raw = lm.full_logprobs(row, eos_step)
            token = self._sample_general(raw, min_active)
        if self.logprobs is not None:
            self.logprobs.append(self._logprob_entry(row, eos_step, raw, token))
        v = self._version.value
        if not self.spans or self.spans[-1][0] != v:
            self.spans.append((v, len(self.token_ids)))
        self.token_ids.append(token)
        self.h = roll(self.h, token)
        if self._counts is not None:
            self._counts[token] = self._counts.get(token, 0) + 1
        if self._seen is not None:
            self._seen.add(token)
        self._check_stop(token)
        return token

    def _sample_general(self, raw: np.ndarray, min_active: bool) -> int:
        p = self.params
        logits = raw.astype(np.float32, copy=True)
        if p.allowed_token_ids:
            mask = np.full(logits.shape, True)
            ids = [i for i in p.allowed_token_ids if 0 <= i < logits.shape[0]]
            mask[ids] = False
            logits[mask] = _NEG_INF
        if self._bad:
            for seq in self._bad:
                if len(seq) == 1 or self.token_ids[-(len(seq) - 1) :] == seq[:-1]:
                    logits[seq[-1]] = _NEG_INF
        if p.logit_bias:
            for tid, b in p.logit_bias.items():
                if 0 <= tid < logits.shape[0]:
                    logits[tid] += np.float32(b)
        if min_active:
            logits[self._min_mask_ids] = _NEG_INF
        if self._seen is not None:
            idx = np.fromiter(self._seen, dtype=np.int64)
            vals = logits[idx]
            logits[idx] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if self._counts:
            idx = np.fromiter(self._counts.keys(), dtype=np.int64)
            cnt = np.fromiter(self._counts.values(), dtype=np.float32)
            logits[idx] -= np.float32(p.frequency_penalty) * cnt + np.float32(p.presence_penalty)
        if p.greedy:
            return int(np.argmax(logits))
        scaled = logits / np.float32(p.temperature)
        mx = scaled.max()
        probs = np.exp((scaled - mx).astype(np.float64))
        if p.top_k > 0 and p.top_k < probs.shape[0]:
            kth = np.partition(probs, -p.top_k)[-p.top_k]
            probs[probs < kth] = 0.0
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            sp = probs[order]
            csum = np.cumsum(sp)
            total = csum[-1]
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            cut = int(np.searchsorted(csum, p.top_p * total, "left")) + 1
            probs[order[cut:]] = 0.0
        if p.min_p > 0.0:
            probs[probs < p.min_p * probs.max()] = 0.0
        cdf = np.cumsum(probs)
        u = self._uniform() * cdf[-1]
        return int(min(np.searchsorted(cdf, u, "right"), probs.shape[0] - 1))

    def _logprob_entry(self, row: int, eos_step: bool, raw: np.ndarray | None, token: int) -> TokenLogprob:
        t = self.lm.tables
        k = self._k
        if not eos_step:
            lp_row = t.logprobs[row]
            lp = float(lp_row[token])
            order = t.order(row)
            rank = 1 if token == int(order[0]) else int(np.count_nonzero(lp_row > lp_row[token])) + 1
            top: list[tuple[int, float, int]] = [(token, lp, rank)]
            if k > 1:
                r = 0
                for tid in order[: k + 1].tolist():
                    r += 1
                    if tid == token:
                        continue
                    top.append((tid, float(lp_row[tid]), r))
                    if len(top) >= k:
                        break
            return TokenLogprob(token, lp, rank, top)
        full = raw if raw is not None else self.lm.full_logprobs(row, True)
        lp = float(full[token])
        rank = int(np.count_nonzero(full > full[token])) + 1
        top = [(token, lp, rank)]
        if k > 1:
            # EOS is the row's best token on an EOS step; the rest keep the table order.
            ordered = [EOS_ID, *[x for x in t.order(row)[: k + 1].tolist() if x != EOS_ID]]
            for r, tid in enumerate(ordered, start=1):
                if tid == token:
                    continue
                top.append((tid, float(full[tid]), r))
                if len(top) >= k:
                    break
        return TokenLogprob(token, lp, rank, top)

    # ------------------------------------------------------------------ stopping
    def _check_stop(self, token: int) -> None:
        p = self.params
        n_out = len(self.token_ids)
        stop_token_hit = False
        if n_out >= p.min_tokens:
            if token == EOS_ID and not p.ignore_eos:
                self.finish_reason, self.stop_reason, stop_token_hit = "stop", None, True
            elif token in self._stop_ids:
                self.finish_reason, self.stop_reason, stop_token_hit = "stop", token, True
        if self.finish_reason is None and n_out >= self.max_out:
            self.finish_reason, self.stop_reason = "length", None
        if self.track_text:
            before = len(self.decoder.text)
            # A stop token's own text is left out unless include_stop_str_in_output.
            if not (stop_token_hit and not p.include_stop_str_in_output):
                self.decoder.add(token)
            if p.stop and n_out > p.min_tokens:
                self._check_stop_strings(len(self.decoder.text) - before)

    def _check_stop_strings(self, new_chars: int) -> None:
        """``check_stop_strings``: the match that completes earliest in the new text wins."""
        if not new_chars:
            return
        text = self.decoder.text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.params.stop:
            i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), i, s)
        if best is None:
            return
        end, start, stop = best
        self.text_cut = end if self.params.include_stop_str_in_output else start
        self.finish_reason, self.stop_reason = "stop", stop

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def abort(self, *, force: bool = False) -> None:
        """End as aborted; ``force`` also overrides a finish met in the same step."""
        if self.finish_reason is None or force:
            self.finish_reason, self.stop_reason = "abort", None

    # ------------------------------------------------------------------ text
    @property
    def text(self) -> str:
        t = self.decoder.text
        return t if self.text_cut is None else t[: self.text_cut]

    def take_text_delta(self) -> str:
        """Text not yet streamed; holds back a possible partial stop string while running."""
        full = self.text
        end = len(full)
        if not self.finished and self.params.stop and not self.params.include_stop_str_in_output:
            end = max(self.emitted_text, end - (self._max_stop - 1))
        delta = full[self.emitted_text : end]
        self.emitted_text = end
        return delta

    # ------------------------------------------------------------------ weight versions
    def weight_versions(self) -> list[dict[str, object]]:
        """Spans over output positions, as vLLM's ``_weight_version_spans`` (``[]`` without tokens)."""
        n = len(self.token_ids)
        out: list[dict[str, object]] = []
        spans = self.spans
        for i, (v, s) in enumerate(spans):
            e = spans[i + 1][1] if i + 1 < len(spans) else n
            out.append({"version": v, "start": s, "end": e})
        return out
