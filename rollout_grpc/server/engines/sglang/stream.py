"""SGLang's `/generate` output objects as neutral events, for cumulative and incremental streams.

SGLang streams are **cumulative by default**: every chunk repeats `text`, `output_ids` and
`meta_info.output_token_logprobs` from the first token; only under the server flag
`--incremental-streaming-output` are they deltas. `meta_info.completion_tokens` is cumulative in
both modes (docs/sglang-http-api.md §3.4), which tells the modes apart chunk by chunk without
asking the server: a chunk is a delta when the tokens seen so far plus its ids make
`completion_tokens`, and a repetition when its ids alone do (with nothing seen yet, both read the
same). The reader turns either into deltas, checks every logprob triple against its token and
ends with `EngineUsage` and one `EngineFinal` from the final `meta_info`.

Two of SGLang 0.5.23's outputs need more (docs/sglang-http-api.md §3.5):

* **The waiting-queue abort echo.** A request aborted while in SGLang's waiting queue (retracted
  under KV pressure, or by a `retract` pause) ends with an output the tokenizer builds itself
  (`_handle_abort_req`, TM:3577-3640): its `meta_info` has no `prompt_tokens`, `cached_tokens` or
  `routed_experts`, its logprob list is whole, and under `--incremental-streaming-output` its
  `output_ids` is only the **last** id while `completion_tokens` counts all. The reader takes the
  missing tokens from the logprob triples (each names its token) and keeps the prompt and cache
  counts the earlier chunks reported, so the call ends ABORTED with every token.
* **The prompt the engine really ran.** Every output's `prompt_tokens` must equal the sample's
  prompt, and with images (`return_prompt_token_ids`) so must every id: SGLang's multimodal
  processors mostly decode ids to text and tokenize again, which can give other ids with no
  error. A difference fails the call (`EngineRejected` on `prompt`) before any token is used.
"""

from __future__ import annotations

from typing import Any, Final

from rollout_grpc.server.domain.model import WeightSpan
from rollout_grpc.server.engines.api import (
    EngineCall,
    EngineDelta,
    EngineError,
    EngineEvent,
    EngineFinal,
    EngineRejected,
    EngineUsage,
    FinishKind,
)
from rollout_grpc.server.engines.sglang import experts
from rollout_grpc.server.engines.sglang.wire import rejection

#: SGLang `finish_reason.type` -> neutral finish (an unknown type counts as a stop, as slime does).
FINISH_MAP: Final[dict[str, FinishKind]] = {
    "stop": FinishKind.STOP,
    "length": FinishKind.LENGTH,
    "abort": FinishKind.ABORT,
}


def _ints(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError(f"{what} must be a list of non-negative integers, got {str(value)[:80]}")
    return value


def _count(value: object, what: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _number(value: object, what: str) -> float:
    if type(value) is float or type(value) is int:
        return float(value)
    raise ValueError(f"{what} must be a number, got {str(value)[:80]}")


def _window(values: object, seen: int, new: int, what: str) -> list[Any]:
    """The entries of the `new` tokens: the list is either those entries or all since the start."""
    if not isinstance(values, list):
        raise ValueError(f"{what} is missing")
    if len(values) == new:
        return values
    if len(values) == seen + new:
        return values[seen:]
    raise ValueError(f"{what} has {len(values)} entries for {new} new tokens after {seen}")


def _logprobs(triples: list[Any], tokens: list[int]) -> list[float]:
    """`[logprob, token_id, text|null]` per token, each naming the token it belongs to."""
    out = []
    for triple, token in zip(triples, tokens, strict=True):
        if not isinstance(triple, list) or len(triple) < 2 or triple[1] != token:
            raise ValueError(f"logprob entry {str(triple)[:80]} does not belong to token {token}")
        out.append(_number(triple[0], "logprob"))
    return out


def _top(rows: list[Any]) -> list[tuple[list[int], list[float]]]:
    """`output_top_logprobs` rows (a list of triples, or null for a position without any)."""
    top = []
    for row in rows:
        cands = row or []
        top.append(
            (
                _ints([c[1] for c in cands], "top logprob token id"),
                [_number(c[0], "top logprob") for c in cands],
            )
        )
    return top


def _spans(value: object, weight_version: object, completion: int) -> list[WeightSpan]:
    """`weight_versions` spans of the call's output; empty ones dropped (SGLang reports
    `[{v, 0, 0}]` before the first token). Without spans, the one `weight_version` covers it all."""
    if value is None:
        return (
            [WeightSpan(weight_version, 0, completion)]
            if isinstance(weight_version, str) and completion
            else []
        )
    if not isinstance(value, list):
        raise ValueError("weight_versions must be a list")
    spans = []
    for s in value:
        start, end = s["start"], s["end"]
        if type(start) is not int or type(end) is not int or not 0 <= start <= end:
            raise ValueError(f"weight_versions span has bad bounds {start!r}..{end!r}")
        if end > start:
            spans.append(WeightSpan(str(s["version"]), start, end))
    return spans


class ChunkReader:
    """The events of one call's output objects, in order (one reader per call)."""

    def __init__(self, url: str, call: EngineCall, experts_topk: int | None) -> None:
        self.url = url
        self.call = call
        self.experts_topk = experts_topk
        #: Tokens delivered so far, and the length of the text they decoded to.
        self.seen = 0
        self.text_len = 0
        #: The last `prompt_tokens` / `cached_tokens` reported (the queued-abort echo has neither).
        self.prompt_tokens: int | None = None
        self.cached_tokens = 0
        #: The sample's prompt as sent (the domain extends its list as tokens arrive).
        self.prompt_len = len(call.prompt_token_ids)
        self.prompt_ids = list(call.prompt_token_ids) if call.features else None
        #: Whether the engine's prompt ids were compared with the sample's.
        self.prompt_checked = False

    def read(self, chunk: Any) -> list[EngineEvent]:
        """One parsed SSE payload (or the non-streaming body) as events; ValueError when unusable."""
        if not isinstance(chunk, dict):
            raise ValueError(f"an output is a JSON {type(chunk).__name__}, not an object")
        if "error" in chunk:
            raise self._error(chunk["error"])
        meta = chunk["meta_info"]
        self._raise_engine_error(meta.get("finish_reason"))
        self._check_prompt(chunk, meta)
        ids = _ints(chunk.get("output_ids") or [], "output_ids")
        total = _count(meta.get("completion_tokens"), "completion_tokens")
        cumulative = total is not None and self.seen and len(ids) == total
        if total is not None and not cumulative and self.seen + len(ids) != total:
            ids = self._queued_abort_ids(meta, ids, total)
            cumulative = True
        new = ids[self.seen :] if cumulative else ids
        delta = EngineDelta(token_ids=new)
        if new:
            triples = _window(meta.get("output_token_logprobs"), self.seen, len(new), "output_token_logprobs")
            delta.logprobs = _logprobs(triples, new)
            if self.call.top_logprobs:
                rows = _window(meta.get("output_top_logprobs"), self.seen, len(new), "output_top_logprobs")
                delta.top_logprobs = _top(rows)
        text = chunk.get("text")
        if self.call.want_text and isinstance(text, str):
            delta.text = text[self.text_len :] if cumulative else text
            self.text_len = len(text) if cumulative else self.text_len + len(text)
        self.seen += len(new)
        events: list[EngineEvent] = [delta]
        finish = meta.get("finish_reason")
        if finish is not None:
            events += self._final(meta, finish)
        return events

    def _check_prompt(self, chunk: dict[str, Any], meta: dict[str, Any]) -> None:
        """The engine's prompt is the sample's: `prompt_tokens` on every output that has it, and
        every id once when the output carries `prompt_token_ids` (asked for with images)."""
        prompt = _count(meta.get("prompt_tokens"), "prompt_tokens")
        if prompt is not None:
            if prompt != self.prompt_len:
                detail = f"{prompt} prompt tokens on the engine, {self.prompt_len} in the sample"
                raise self._prompt_differs(detail)
            self.prompt_tokens = prompt
            self.cached_tokens = _count(meta.get("cached_tokens"), "cached_tokens") or 0
        engine_ids = chunk.get("prompt_token_ids")
        sample = self.prompt_ids
        if engine_ids is None or sample is None or self.prompt_checked:
            return
        engine_ids = _ints(engine_ids, "prompt_token_ids")
        if engine_ids != sample:
            at = next(
                (i for i, (a, b) in enumerate(zip(engine_ids, sample, strict=False)) if a != b),
                min(len(engine_ids), len(sample)),
            )
            got = engine_ids[at] if at < len(engine_ids) else "nothing"
            want = sample[at] if at < len(sample) else "nothing"
            raise self._prompt_differs(
                f"prompt position {at} is {got} on the engine and {want} in the sample "
                f"({len(engine_ids)} vs {len(sample)} tokens)"
            )
        self.prompt_checked = True

    def _prompt_differs(self, detail: str) -> EngineRejected:
        return EngineRejected(
            self.url,
            f"the engine ran another prompt than the sample's: {detail}. SGLang's multimodal "
            "processors decode input_ids to text and tokenize again unless the model's processor "
            "keeps ids (docs/sglang-http-api.md §9): the samples would be off-policy",
            "prompt",
        )

    def _queued_abort_ids(self, meta: dict[str, Any], ids: list[int], total: int) -> list[int]:
        """Every output id of the waiting-queue abort echo, from its whole logprob list (its
        `output_ids` is only the last id when streaming incrementally); ValueError for any other
        chunk whose ids do not add up."""
        finish = meta.get("finish_reason")
        triples = meta.get("output_token_logprobs")
        if not (
            isinstance(finish, dict)
            and finish.get("type") == "abort"
            and total >= self.seen
            and isinstance(triples, list)
            and len(triples) == total
        ):
            raise ValueError(f"{len(ids)} output ids after {self.seen} do not make {total} tokens")
        named = [t[1] if isinstance(t, list) and len(t) >= 2 else None for t in triples]
        every = _ints(named, "logprob token id")
        if ids and every[-len(ids) :] != ids:
            raise ValueError(f"the abort's output ids {ids[:8]} are not the end of its logprob tokens")
        return every

    def _error(self, error: object) -> EngineError:
        """An in-stream `{"error": {"message"}}`: SGLang's `ValueError`, a 400 unless a code says
        (a bare string is the contract gate's 400)."""
        if isinstance(error, str):
            return rejection(self.url, 400, error or "error event")
        if not isinstance(error, dict):
            return rejection(self.url, 500, f"error event: {error}")
        code = error.get("code")
        status = code if type(code) is int else 400
        return rejection(self.url, status, str(error.get("message", "")) or "error event")

    def _raise_engine_error(self, finish: object) -> None:
        """A scheduler-side error reported as an abort with an error status (docs/sglang-http-api.md
        §3.1, §7), read before anything else of its chunk: a request the scheduler refuses (a
        prompt within six tokens of the context, a bad start) runs a one-token stub prompt, so
        that chunk's `prompt_tokens` and ids are the stub's, not the sample's."""
        if not isinstance(finish, dict) or finish.get("type") != "abort":
            return
        status = finish.get("status_code")
        if type(status) is int and status >= 400:
            raise rejection(self.url, status, str(finish.get("message") or "aborted by the engine"))

    def _final(self, meta: dict[str, Any], finish: object) -> list[EngineEvent]:
        if not isinstance(finish, dict):
            raise ValueError(f"finish_reason must be an object, got {str(finish)[:80]}")
        kind = FINISH_MAP.get(str(finish.get("type")), FinishKind.STOP)
        # The queued-abort echo reports neither: keep what the earlier outputs said (the sample's
        # prompt when none came, as nothing contradicted it).
        prompt = self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len
        cached = self.cached_tokens
        final = EngineFinal(
            finish=kind,
            stop_reason=self._stop_reason(finish) if kind is FinishKind.STOP else None,
            weight_spans=_spans(meta.get("weight_versions"), meta.get("weight_version"), self.seen),
            routed_experts=self._routed(meta, prompt),
        )
        return [EngineUsage(prompt, cached), final]

    def _stop_reason(self, finish: dict[str, Any]) -> int | str | None:
        """`matched` as vLLM's `stop_reason`: the stop string or stop token id, None for EOS
        (SGLang reports the EOS id as `matched`; it is EOS when the caller did not list it)."""
        matched = finish.get("matched")
        if isinstance(matched, str):
            return matched
        if type(matched) is int and matched in self.call.sampling.stop_token_ids:
            return matched
        return None

    def _routed(self, meta: dict[str, Any], prompt: int) -> Any:
        encoded = meta.get("routed_experts")
        if not self.call.return_routed_experts or encoded is None:
            return None
        if not isinstance(encoded, str):
            raise ValueError("routed_experts must be a base64 string")
        if not self.experts_topk:
            raise ValueError(
                "routed_experts cannot be shaped: SGLang does not report the model's top-k; start the "
                "replica with --sglang-experts-topk"
            )
        rows = prompt + self.seen - 1 - self.call.routed_experts_start
        return experts.decode(encoded, rows, self.experts_topk)
