"""Plain-Python types of the rollout domain (no protobuf, no HTTP).

`front/grpc/convert.py` maps them to and from the proto messages; `rollout/generation.py` works on
them. Fields the domain never changes (index, group index, reward, metadata) stay on the request proto and are
copied through by the transport, so they cost nothing here.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np


class Status(enum.IntEnum):
    """Mirrors `rollout.v1.SampleStatus` (same numbers)."""

    UNSPECIFIED = 0
    PENDING = 1
    COMPLETED = 2
    TRUNCATED = 3
    ABORTED = 4
    FAILED = 5


class Finish(enum.IntEnum):
    """Mirrors `rollout.v1.FinishReason` (same numbers)."""

    UNSPECIFIED = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4
    REPETITION = 5


@dataclass(slots=True)
class SamplingParams:
    """Sampling knobs; None means "not set by the caller" (see the proto for defaults)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    spaces_between_special_tokens: bool | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int | None = None


@dataclass(slots=True)
class GenerateOptions:
    """Per-call service options."""

    mask_offpolicy: bool = False
    return_routed_experts: bool = False
    stream_batch_tokens: int = 64
    stream_batch_interval_s: float = 0.2
    final_only: bool = False
    skip_text: bool = False
    model: str = ""
    routed_experts_start: int = 0
    #: When the caller stops waiting, on the `time.monotonic()` clock (None: no deadline). The
    #: generation ends with its sample shortly before (`bounds.deadline_margin_s`). Set by the
    #: door from its transport's deadline (gRPC's `time_remaining()`); never a transport object.
    deadline: float | None = None


@dataclass(slots=True)
class WeightSpan:
    """Tokens [start, end) of the response were produced under `version`."""

    version: str
    start: int
    end: int


@dataclass(slots=True)
class Usage:
    """Token accounting summed over the sample's generation calls."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class RoutedExperts:
    """R3 routing: `array` has shape [num_tokens, num_layers, topk]; row i is position start + i."""

    array: np.ndarray
    start: int = 0


@dataclass(slots=True)
class MultimodalItem:
    """One media item: its hash, placeholder range in the token ids, and opaque engine payloads."""

    mm_hash: str
    offset: int
    length: int
    kwargs_data: bytes | None = None
    mm_metadata: bytes | None = None
    placeholder_token_id: int = 0


@dataclass(slots=True)
class MultimodalFeatures:
    """Items per modality, in placeholder order (insertion order of the dict is kept)."""

    modalities: dict[str, list[MultimodalItem]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return any(self.modalities.values())


@dataclass(slots=True)
class EngineAttempt:
    """One engine call of a generation: response positions [start, end) and why it ended early."""

    engine: str
    start: int
    end: int
    error: str = ""


@dataclass(slots=True)
class Sample:
    """The parts of a rollout sample that generation reads or writes.

    The token ids are kept in two parts: `prompt_ids`, an immutable tuple that the n samples of a
    group share (a group of 64 over a 32k-token prompt holds the prompt once, not 64 times: 8 bytes
    a token a copy), and `response_ids`, this sample's own. The wire's single `tokens` list (prompt
    then response) is built only where a message or an engine request carries it (`token_ids()`).
    """

    session_id: str = ""
    group_index: int = 0
    prompt: str | None = None
    #: The prompt's token ids, never mutated (replace the tuple instead): shared between samples.
    prompt_ids: tuple[int, ...] = ()
    #: The response's token ids (this sample's own); `response_length` of them when the input was valid.
    response_ids: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    status: Status = Status.PENDING
    finish_reason: Finish = Finish.UNSPECIFIED
    stop_reason: int | str | None = None
    failure_reason: str = ""
    weight_versions: list[WeightSpan] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    routed_experts: RoutedExperts | None = None
    features: MultimodalFeatures | None = None
    engine_attempts: list[EngineAttempt] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)

    @property
    def token_count(self) -> int:
        """Prompt and response tokens, without building their concatenation."""
        return len(self.prompt_ids) + len(self.response_ids)

    def token_ids(self) -> tuple[int, ...]:
        """Prompt then response as one sequence (what the wire and the engines carry): the shared
        prompt itself while there is no response, else a new tuple."""
        if not self.response_ids:
            return self.prompt_ids
        return (*self.prompt_ids, *self.response_ids)

    def iter_token_ids(self) -> Iterator[int]:
        """Prompt then response ids, without a copy."""
        return itertools.chain(self.prompt_ids, self.response_ids)


def split_tokens(tokens: Sequence[int], response_length: int) -> tuple[tuple[int, ...], list[int]]:
    """The (prompt, response) parts of a wire sample's `tokens`, whose last `response_length` are
    the response. A length that does not fit (negative, or the whole list or more) leaves every id
    in the prompt, so that `sample_ops.check_input` still sees the caller's numbers and names them."""
    if 0 < response_length < len(tokens):
        cut = len(tokens) - response_length
        return tuple(tokens[:cut]), list(tokens[cut:])
    return tuple(tokens), []


@dataclass(slots=True)
class TokenBatch:
    """New response tokens for the stream: `offset` is the response position of the first one."""

    token_ids: list[int]
    logprobs: list[float]
    offset: int
    text: str = ""
