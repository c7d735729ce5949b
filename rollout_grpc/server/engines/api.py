"""The engine boundary: what the domain asks of an engine and what it gets back, engine-neutral.

`rollout/generation.py` talks to engines only through `EngineAdapter` and these types; an adapter
sub-package (`engines/vllm/` today) is the only place that knows an engine's HTTP paths, JSON keys,
status codes and request-id scheme. A second engine kind is one more sub-package, named in
`engines/registry.py` (docs/engines.md, docs/architecture.md).

Errors are split by what the caller of the adapter can do about them, not by how the engine
reported them (HTTP status or an error event inside a 200 stream are the same thing here):

* `EngineRejected` — the engine refused the request as invalid (a caller error, carries `param`);
* `EngineUnavailable` — no (complete) answer: refused connection, broken or silent stream;
* `EngineRequestFailed` — the engine answered this request with an internal error;
* `EngineMalformed` — the engine answered something this service cannot parse;
* `MediaCacheMiss` — a call that sent media by hash only failed the way a cache miss does.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Protocol

import numpy as np

from rollout_grpc.server.domain.chat import ChatRenderRequest, ServedModel
from rollout_grpc.server.domain.model import MultimodalFeatures, SamplingParams, WeightSpan


class FinishKind(enum.Enum):
    """Why an engine call ended, in neutral terms (the adapter maps the engine's strings)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REPETITION = "repetition"


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One generate call: everything an adapter needs, already resolved by the domain."""

    #: This engine call's unique id, built by the domain (`rollout/call_ids.py`): unique per
    #: replica, owner, request id and attempt; the adapter sends it in its engine's form
    #: (`EngineAdapter.engine_request_id`) and never derives ids of its own.
    call_id: str
    #: 0 for the first engine call of a Generate, then 1, 2, ... for failover calls (already part
    #: of `call_id`; for logs and engine-specific behaviour only).
    attempt: int
    #: Prompt then response so far: the group's shared prompt tuple itself on a first call, so
    #: that n calls of a group do not each hold a copy (read only).
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    #: Tokens this call may still produce (the remaining budget), None for the engine's limit.
    max_tokens: int | None
    #: Tokens this call must produce before a stop may end it (0 for none).
    min_tokens: int
    #: Ask the engine to batch this many tokens per stream event (1 = every token).
    stream_interval: int = 1
    #: Candidates per position to return with each token (0 = the sampled token's logprob only).
    top_logprobs: int = 0
    return_routed_experts: bool = False
    #: First prompt position whose routing the engine returns (multi-turn reuse).
    routed_experts_start: int = 0
    features: MultimodalFeatures | None = None
    #: Send every media item's tensors even if the engine should hold them (after a cache miss).
    resend_media: bool = False
    model: str = ""
    #: Detokenize and return text deltas.
    want_text: bool = True


@dataclass(slots=True)
class EngineDelta:
    """New output of one stream event; an empty delta still means the engine holds the request."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Per token (candidate ids, candidate logprobs) when top logprobs were asked for, else None.
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    text: str = ""


@dataclass(frozen=True, slots=True)
class EngineUsage:
    """Prompt accounting reported by the engine for this call."""

    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class EngineFinal:
    """How the call ended: its delta (already yielded before this) is complete."""

    finish: FinishKind
    stop_reason: int | str | None = None
    #: Weight versions of this call's output tokens; positions relative to this call's first token.
    weight_spans: list[WeightSpan] = field(default_factory=list)
    #: R3 routing, shape [positions, layers, topk], first row = `EngineCall.routed_experts_start`.
    routed_experts: np.ndarray | None = None


EngineEvent = EngineDelta | EngineUsage | EngineFinal


@dataclass(slots=True)
class EngineCapabilities:
    """What the capability check found out about an engine; None where the engine did not say.

    The one source of these facts: `capabilities.CapabilityChecker` sets it on the `EngineHandle`
    at start and whenever the engine joins or comes back healthy; routing and the generation path
    read it from there and never ask the engine again.
    """

    scale_out: bool | None = None
    dev_mode: bool | None = None
    logprobs_mode: str = ""
    is_moe: bool | None = None
    #: Whether the engine returns routed experts (R3) when asked.
    routed_experts: bool | None = None
    model: str = ""
    max_model_len: int | None = None
    #: True when one engine call with `n > 1` is known to keep abort-without-loss per choice
    #: (per-choice abort, final chunk and weight versions): the hook for RolloutStep to generate a
    #: group in one call with a shared prefill. No kind sets it yet: vLLM 0.32's per-choice abort is
    #: unverified, so a group is n calls on one session key (docs/rollout-step.md "Decisions").
    group_choices: bool = False
    #: The engine flag that turns routed experts on (named in `routed_experts_problem`).
    routed_experts_flag: str = "the routed-experts flag"
    #: Why the engine cannot serve the contract (each names the flag to add): not routed to.
    problems: list[str] = field(default_factory=list)
    #: What is wrong but leaves the engine in rotation.
    warnings: list[str] = field(default_factory=list)

    def routed_experts_problem(self, url: str) -> str | None:
        """Why the engine at `url` cannot return routed experts (R3), or None when it can or does
        not say (then its reply decides)."""
        if self.is_moe is False:
            return (
                f"engine {url} serves a dense model, which has no expert routing to return "
                "(R3 needs a mixture-of-experts model)"
            )
        if self.routed_experts is False:
            return f"engine {url} was not started with {self.routed_experts_flag}"
        return None


@dataclass(frozen=True, slots=True)
class Rendered:
    """Prompt token ids from the engine's tokenizer/processor, with media features if any."""

    token_ids: list[int]
    features: MultimodalFeatures | None = None


@dataclass(frozen=True, slots=True)
class EngineTimeouts:
    """Timeouts and limits of engine calls.

    There is no total limit on a generation (it may legitimately take hours, and the engine holds
    requests while paused) unless the gRPC caller set a deadline. Instead a stream silent for
    `idle` seconds is checked with a `liveness` probe: an engine that answers keeps its stream (it
    may be paused, or prefilling a long prompt), one that does not is treated as hung.
    """

    connect: float = 5.0
    #: aiohttp's socket read timeout (None = off; the idle check below is the stream guard).
    sock_read: float | None = None
    control: float = 30.0
    #: Seconds without a byte from a generate stream before the engine is probed.
    idle: float = 30.0
    #: Seconds the liveness probe of a silent engine may take.
    liveness: float = 2.0
    #: Largest accepted SSE line (R3 at 32k tokens x 48 layers x top-8 is ~16 MB).
    max_event_bytes: int = 256 * 1024 * 1024


class EngineError(Exception):
    """Base class of engine failures; `url` names the engine, `message` is safe to show."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url
        self.message = message


class EngineRejected(EngineError):
    """The engine refused the request as invalid: the caller's error, never retried elsewhere.

    `param` is the engine's name of the offending field when it gave one; `not_found` marks an
    unknown model or route (a caller error too, reported as NOT_FOUND).
    """

    def __init__(self, url: str, message: str, param: str | None = None, *, not_found: bool = False) -> None:
        super().__init__(url, message)
        self.param = param
        self.not_found = not_found


class EngineUnavailable(EngineError):
    """No complete answer: connection refused, stream broken or closed early, engine gone."""


class EngineHung(EngineUnavailable):
    """The stream went silent and the engine did not answer a liveness probe either."""


class EngineRequestFailed(EngineError):
    """The engine answered this request with an internal error (HTTP 5xx or an error event).

    Alone it does not say whether the engine or the request is at fault; the failover policy
    asks the engine's health to tell them apart.
    """


class EngineMalformed(EngineError):
    """The engine's reply cannot be parsed or breaks the protocol (bad JSON, ids, logprobs, spans)."""


class MediaCacheMiss(EngineError):
    """A call that sent media by hash only failed as a cache miss; the adapter forgot the hashes."""


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """A health probe's answer: truthy when the engine is healthy, else `cause` says why, in words
    an operator acts on ("connection refused", "no answer within 2.0 s", "GET /health answered
    HTTP 503", "answers HTTP but is not a vLLM server")."""

    ok: bool
    cause: str = ""

    def __bool__(self) -> bool:
        return self.ok


HEALTHY = EngineHealth(True)


def describe_transport_error(exc: BaseException, timeout: float | None = None) -> str:
    """A connection-level failure in an operator's words (refused, timed out, unresolvable)."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s" if timeout else "no answer (timed out)"
    cause: BaseException | None = exc
    for _ in range(4):  # the error, what it wraps (aiohttp's `os_error`), and their causes
        if cause is None:
            break
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused (nothing listens on that port)"
        if isinstance(cause, ConnectionResetError):
            return "connection reset by the engine"
        if isinstance(cause, socket.gaierror):
            return f"the host name does not resolve ({cause.strerror})"
        cause = getattr(cause, "os_error", None) or cause.__cause__
    return f"{type(exc).__name__}: {exc}"


class ControlAction(enum.StrEnum):
    """A fleet-control operation, named so an adapter can say which of its routes does it."""

    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"
    UPDATE_WEIGHT_VERSION = "update_weight_version"


class WeightAction(enum.StrEnum):
    """A weight operation (`rollout/weights/`), named so an adapter can say which route does it."""

    LOAD_CHECKPOINT = "load_checkpoint"
    RELEASE_MEMORY = "release_memory"
    RESUME_MEMORY = "resume_memory"
    TRANSFER_RANKS = "transfer_ranks"
    INIT_TRANSFER = "init_transfer"
    RECEIVE_WEIGHTS = "receive_weights"


@dataclass(frozen=True, slots=True)
class TransferGroup:
    """The collective group a trainer broadcasts new weights in (distributed weight transfer)."""

    backend: str
    master_address: str
    master_port: int
    group_name: str
    world_size: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor the trainer broadcasts: checkpoint name, torch dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


#: The memory regions a colocated trainer frees and takes back (vLLM's and SGLang's tag names).
MEMORY_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True, slots=True)
class MemoryRelease:
    """What a colocated trainer asks an engine to free (`EngineAdapter.release_memory`).

    `level` is vLLM's sleep level (1: offload the weights, drop the KV cache; 2: drop both; 0:
    nothing); SGLang has no levels and frees the regions `tags` names (`MEMORY_TAGS`; empty: all).
    """

    level: int = 1
    tags: tuple[str, ...] = ()


class EngineAdapter(Protocol):
    """One engine, as the domain sees it. `vllm.VllmEngine` is the production implementation."""

    url: str
    #: The engine kind's name ("vllm", "sglang"), as the `KIND+` prefix of an engine URL spells it.
    kind: str
    #: What an operator does when one of this engine kind's control routes answers 404.
    missing_route_hint: str

    def control_route(self, action: ControlAction) -> str:
        """The engine route behind `action`, for messages that tell an operator which call failed."""
        ...

    def engine_request_id(self, call_id: str) -> str:
        """The id the engine knows the call `call_id` (`EngineCall.call_id`) by: what
        `abort_requests` takes, and the only id an abort of that call may send.

        `call_id` is already unique in the fleet (replica instance, owner, request id, attempt)
        and ends with `~`, which occurs nowhere else but between its parts, so no call id is a
        prefix of another. An adapter only maps it to what its engine tracks (vLLM prefixes
        `generate-tokens-`; an engine that tracks ids verbatim returns `call_id` unchanged) and
        must keep the mapping injective and prefix-free.
        """
        ...

    def generate(self, call: EngineCall) -> AsyncIterator[EngineEvent]:
        """Run one generate call, yielding deltas, usage and, last, exactly one `EngineFinal`.

        Raises the `EngineError` subclasses above. Leaving the iteration early closes the call,
        which makes the engine abort it.
        """
        ...

    async def health(self, timeout: float = 2.0) -> EngineHealth:
        """A short liveness check: falsy, with its cause, when the engine does not answer healthy
        in time."""
        ...

    async def abort_requests(self, engine_request_ids: list[str]) -> None:
        """Abort these engine-side calls."""
        ...

    async def render_text(self, text: str, model: str = "") -> Rendered:
        """Tokenize a plain prompt with the engine's tokenizer (no template)."""
        ...

    async def render_chat(self, request: ChatRenderRequest) -> Rendered:
        """Render a conversation with the engine's template and media processor."""
        ...

    # Fleet control (control.py).

    async def pause(self, mode: str, timeout: float | EllipsisType | None = ...) -> None:
        """Pause generation (`abort`, `wait` or `keep`); forgets media the engine may have dropped."""
        ...

    async def resume(self) -> None:
        """Resume generation (idempotent)."""
        ...

    async def is_paused(self) -> bool:
        """Whether the engine is paused."""
        ...

    async def update_weight_version(self, version: str) -> None:
        """Label later output tokens with `version`."""
        ...

    async def weight_version(self) -> str:
        """The engine's current weight-version label."""
        ...

    async def models(self) -> list[ServedModel]:
        """The models the engine serves."""
        ...

    # Weight updates (rollout/weights/): the engine kind's module `weights.py` implements them.

    def weight_route(self, action: WeightAction) -> str:
        """The engine route behind a weight operation, for messages naming the failed call."""
        ...

    async def load_checkpoint(self, path: str, timeout: float | None) -> None:
        """Load the checkpoint at `path` (a directory the engine can read) into the running model,
        in place; the caller paused the engine first. Raises an `EngineError` with the engine's own
        cause when the engine did not load it (vLLM 0.32 is then left without usable weights:
        docs/engines.md "Weight updates")."""
        ...

    async def transfer_ranks(self) -> int:
        """How many ranks this engine has in a weight-transfer group (its workers)."""
        ...

    async def init_transfer(self, group: TransferGroup, rank_offset: int, timeout: float | None) -> None:
        """Join `group` with ranks from `rank_offset` on; blocks until every rank joined."""
        ...

    async def receive_weights(
        self, group: TransferGroup, tensors: Sequence[TensorSpec], timeout: float | None
    ) -> None:
        """Receive `tensors` broadcast by the trainer (rank 0) in `group` and load them in place;
        the caller paused the engine first."""
        ...

    async def release_memory(self, release: MemoryRelease) -> None:
        """Free the accelerator memory `release` names (vLLM `/sleep`, SGLang
        `/release_memory_occupation`); the caller paused the engine (ABORT) first."""
        ...

    async def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Take back the memory regions `tags` names (all when empty): vLLM `/wake_up`, SGLang
        `/resume_memory_occupation`."""
        ...

    async def capabilities(self, raw_logprobs: str) -> EngineCapabilities | None:
        """Probe and classify the engine (its problems name this engine kind's flags); None when
        the adapter has nothing to report. `raw_logprobs` is the replica's policy for engines
        that return logprobs before sampling (`refuse` makes it a problem, `warn` a warning)."""
        ...
