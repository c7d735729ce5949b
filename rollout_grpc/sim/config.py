"""Configuration of a simulated engine and of its fault switches.

``SimConfig`` mirrors the ``vllm serve`` flags that change what a client sees (served name,
``--max-model-len``, ``--enable-scale-out``, ``VLLM_SERVER_DEV_MODE``, ``--max-logprobs``,
``--enable-return-routed-experts``, a multimodal model) plus simulator knobs (speed, EOS rate,
seed). ``FaultConfig`` holds the failure modes tests switch on; it is mutable at runtime, from
Python (``SimEngine.faults``) and, in the simulator's own tests, over HTTP (``POST /_sim/faults``,
mounted from ``tests/support/sim_admin.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

#: The ways the ``malformed`` fault can break a stream chunk (see ``FaultConfig``).
MALFORMED_KINDS = (
    "invalid_json",
    "array_chunk",
    "missing_logprob",
    "string_token_ids",
    "bad_weight_spans",
    "huge_line",
    "negative_token_ids",
)

#: Fault counters: 0 = off, N > 0 = the next N generate requests (then off), -1 = every request.
PERSISTENT = -1


@dataclass
class FaultConfig:
    """Failure modes. Count fields are one-shot (N>0, decremented per affected request) or
    persistent (-1); 0 switches them off.

    * ``http_500``: generate answers 500 ``Internal server error`` (vLLM envelope) before any
      token; nothing is counted as in flight.
    * ``stream_error``: after ``stream_error_after`` tokens of choice 0 the stream carries
      ``data: {"error":{…"InternalServerError"…,"code":500}}`` then ``data: [DONE]`` (HTTP status
      stays 200); a non-streaming request answers 500 at that point.
    * ``drop_connection``: after ``drop_after_tokens`` tokens the server closes the TCP
      connection without finishing the response (stream and non-stream).
    * ``hang``: the request is accepted and never answered (until the client gives up or the
      engine stops). It is not in the engine, so aborts and pauses do not touch it.
    * ``logprob_mismatch``: ``logprobs.content`` has ``logprob_mismatch_drop`` fewer entries than
      ``token_ids`` (non-stream: the last entries; stream: the final chunk's entries).
    * ``dead``: ``/health`` answers 503 and generate answers 500 (``EngineDeadError``).
    * ``routed_experts_unavailable``: ``routed_experts`` is null even on a MoE engine with
      ``return_routed_experts``, as on vLLM started without ``--enable-return-routed-experts``.
    * ``malformed``: one stream chunk of choice 0, the first sent after ``malformed_after`` tokens,
      is broken as ``malformed_kind`` says (streaming only; the stream then goes on normally):

      - ``invalid_json``: a ``data:`` line that is not JSON (the chunk's tokens are not sent);
      - ``array_chunk``: a JSON array instead of the chunk object;
      - ``missing_logprob``: the logprob entries lack their ``logprob``;
      - ``string_token_ids``: ``token_ids`` as strings;
      - ``bad_weight_spans``: the final chunk's ``weight_versions`` span has a string start and a
        float end (applied to the final chunk whatever ``malformed_after`` says);
      - ``huge_line``: the chunk is valid but padded with 1 MiB of JSON whitespace (a reader
        with a line-length cap fails; a correct client sees nothing unusual);
      - ``negative_token_ids``: the chunk's token ids are negative.
    * ``request_500_seed``: when >= 0, every generate whose ``sampling_params.seed`` equals it answers
      HTTP 500 ``Internal server error`` before any token, on every engine with the same setting: a
      request-specific failure (the engine stays healthy and serves other requests), like vLLM's
      answer to ``kwargs_data`` that does not decode. Not a count: it stays until cleared.
    * ``pause_delay_ms``: ``/pause`` takes effect, and answers, this many milliseconds late, while
      generation goes on and ``/health`` answers: vLLM runs a pause in its engine-core loop between
      engine steps, so it waits for the step in progress (a long prefill — an image on a loaded CPU
      — takes seconds). Not a count: it stays until cleared.
    * ``load_fault``: how the next checkpoint loads fail (``weights.py``): ``error`` (the worker
      raises), ``hang`` (never answers), ``drop`` (the connection closes: the engine crashed).
      ``load_delay_ms`` delays every load's answer. Not counts: they stay until cleared.
    * ``resume_fault``: how ``/resume`` fails: ``hang`` (no answer, and no resume, while it stays
      set; what it then does follows the new value), ``error`` (answers 503 without resuming: an
      engine that is up but cannot take control calls). Not a count: it stays until cleared.
    """

    http_500: int = 0
    stream_error: int = 0
    stream_error_after: int = 1
    drop_connection: int = 0
    drop_after_tokens: int = 1
    hang: int = 0
    logprob_mismatch: int = 0
    logprob_mismatch_drop: int = 1
    dead: bool = False
    routed_experts_unavailable: bool = False
    malformed: int = 0
    malformed_kind: str = "invalid_json"
    malformed_after: int = 1
    request_500_seed: int = -1
    pause_delay_ms: int = 0
    load_fault: str = ""
    load_delay_ms: int = 0
    resume_fault: str = ""

    def take(self, name: str) -> bool:
        """Consume one use of a count fault; True when it applies to this request."""
        v: int = getattr(self, name)
        if v == 0:
            return False
        if v > 0:
            setattr(self, name, v - 1)
        return True

    def update(self, values: dict[str, Any]) -> None:
        """Set fields from a JSON object; unknown names raise ``KeyError``."""
        known = {f.name: f for f in fields(self)}
        for k, v in values.items():
            if k not in known:
                raise KeyError(k)
            cur = getattr(self, k)
            if isinstance(cur, bool):
                setattr(self, k, bool(v))
            elif isinstance(cur, str):
                if k == "malformed_kind" and v not in MALFORMED_KINDS:
                    raise KeyError(f"{k}={v!r}; one of {', '.join(MALFORMED_KINDS)}")
                setattr(self, k, str(v))
            else:
                setattr(self, k, int(v))

    def clear(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SGLangOptions:
    """Server arguments of a simulated SGLang engine (``SimConfig(kind="sglang")``) that change what
    a client sees; see ``docs/sglang-http-api.md``.

    * ``incremental_streaming_output`` (``--incremental-streaming-output``): stream chunks carry only
      the new ``text``/``output_ids``/``output_token_logprobs``; off (SGLang's default) every chunk
      is cumulative.
    * ``weight_version`` (``--weight-version``): the version string before any update.
    * ``stream_interval`` (``--stream-interval``): tokens between stream chunks when the request does
      not set ``sampling_params.stream_interval``.
    * ``version``: what ``/get_server_info`` reports as the SGLang version.
    * ``enable_deterministic_inference`` (``--enable-deterministic-inference``): ``sampling_seed`` is
      used (42 when a request sets none); off (SGLang's default) it is ignored and sampling is
      random (``sampling/sampling_batch_info.py`` 157-172 of SGLang 0.5.23).
    * ``processor_keeps_input_ids``: the multimodal processor keeps ``input_ids`` as sent (SGLang's
      ``prefer_tokenized_input`` processors); off, ids sent with images are decoded to text and
      tokenized again, as most of SGLang 0.5.23's processors do.

    ``SimConfig.return_routed_experts`` is ``--enable-return-routed-experts``,
    ``SimConfig.tokens_only`` is ``--skip-tokenizer-init`` and ``SimConfig.max_model_len`` the
    context length.
    """

    incremental_streaming_output: bool = False
    weight_version: str = "default"
    stream_interval: int = 1
    version: str = "0.0.0-sim"
    enable_deterministic_inference: bool = False
    processor_keeps_input_ids: bool = False


@dataclass
class SimConfig:
    """A simulated vLLM 0.32 engine.

    Model and limits: ``model`` (served name), ``model_root`` (``root`` in ``/v1/models``;
    default ``sim-models/<model>``), ``vocab_size``, ``max_model_len``, ``max_logprobs``,
    ``max_num_seqs`` (upper bound for ``n``).

    Speed: ``ttft_s`` before the first token of a request, ``token_delay_s`` between later
    tokens (asyncio sleeps; zero means "as fast as the event loop allows", yielding between
    tokens so hundreds of requests progress together).

    Model behaviour: ``model_seed`` selects the toy model's "weights" (its tables and MoE routing;
    keep it equal across a fleet, like one checkpoint served by many engines); ``seed`` seeds the
    stream used for requests without ``sampling_params.seed``; ``eos_probability`` is the
    per-step chance that EOS becomes the likely next token (0 = never stop early).

    Gating: ``scale_out`` (``--enable-scale-out``; off ⇒ 403 on generate/render/abort),
    ``dev_mode`` (``VLLM_SERVER_DEV_MODE``; off ⇒ 404 on pause/resume/weights/…),
    ``tokens_only`` (``--tokens-only``: no tokenizer endpoints, no text mode or stop strings),
    ``server_load_tracking`` (``--enable-server-load-tracking``; off ⇒ ``/load`` stays 0).

    MoE (R3): ``moe_layers``, ``moe_experts``, ``moe_topk``; ``return_routed_experts`` turns on
    ``choices[i].routed_experts`` (``--enable-return-routed-experts``). ``moe_experts=0`` is a dense
    model; with ``return_routed_experts`` and no experts configured, tiny-qwen3moe's 8 are used.
    ``/server_info`` reports ``parallel_config.is_moe_model`` and
    ``aux_output_config.enable_return_routed_experts`` accordingly.

    Multimodal: ``multimodal`` makes it a Qwen2-VL-like model (render with images, generate with
    ``features``); ``image_min_tokens``/``image_max_tokens`` clamp the placeholder count
    (the tiny Qwen2-VL: 4 and 16); ``limit_images`` caps images per prompt.

    ``faults`` is the initial fault state (see ``FaultConfig``).

    ``kind`` picks the HTTP personality: ``"vllm"`` (vLLM 0.32, the default) or ``"sglang"`` (SGLang's
    native ``/generate`` API, ``rollout_grpc/sim/sglang/``, configured further by ``sglang``). Both
    run the same engine core and toy model.
    """

    model: str = "sim-llama"
    model_root: str | None = None
    vocab_size: int = 2048
    max_model_len: int = 4096
    token_delay_s: float = 0.0
    ttft_s: float = 0.0
    seed: int = 0
    model_seed: int = 0
    #: The weight-transfer backend the engine was started with (vLLM's `--weight-transfer-config`,
    #: e.g. "nccl"); "" answers every transfer route "Weight transfer not configured" (measured).
    weight_transfer: str = ""
    eos_probability: float = 0.01
    dev_mode: bool = True
    scale_out: bool = True
    tokens_only: bool = False
    server_load_tracking: bool = True
    max_logprobs: int = 20
    max_num_seqs: int = 256
    moe_layers: int = 2
    moe_experts: int = 0
    moe_topk: int = 2
    return_routed_experts: bool = False
    multimodal: bool = False
    #: vLLM's ``--logprobs-mode`` as reported by ``/server_info`` (vLLM's default is raw_logprobs).
    logprobs_mode: str = "raw_logprobs"
    image_min_tokens: int = 4
    image_max_tokens: int = 16
    limit_images: int = 2
    last_requests_kept: int = 64
    faults: FaultConfig = field(default_factory=FaultConfig)
    kind: str = "vllm"
    sglang: SGLangOptions = field(default_factory=SGLangOptions)

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0 or self.return_routed_experts

    @property
    def num_experts(self) -> int:
        return self.moe_experts if self.moe_experts > 0 else 8

    @property
    def root(self) -> str:
        return self.model_root if self.model_root is not None else f"sim-models/{self.model}"
