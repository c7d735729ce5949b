"""What both clients share: channel options (limits, retry policy), request building, batch sniffing.

Kept apart from aio.py and sync.py so that the two clients differ only in how they wait.
"""

from __future__ import annotations

import json
import math
import numbers
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.samples import OptionsLike, ParamsLike, SampleLike, to_options, to_params, to_sample

#: Receive limit large enough for a long sample's routed experts in one message.
DEFAULT_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]

SERVICE_NAME = "rollout.v1.RolloutService"


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's own retries (service config) for calls the server refused before doing anything.

    The replica answers RESOURCE_EXHAUSTED when its admission queue is full and UNAVAILABLE when no
    engine is up or it is shutting down, both with a `grpc-retry-pushback-ms` trailer; gRPC then
    waits exactly that long before the next attempt (instead of its own backoff). A call is never
    retried once the server has sent a message, so a stream is never replayed halfway.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    backoff_multiplier: float = 2.0
    retryable_codes: tuple[str, ...] = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")

    def service_config(self) -> str:
        """The `grpc.service_config` JSON applying this policy to every RolloutService method."""
        if not 2 <= self.max_attempts <= 5:
            raise ValueError(f"max_attempts must be in [2, 5] (gRPC caps it at 5), got {self.max_attempts}")
        policy = {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff_s:.3f}s",
            "maxBackoff": f"{self.max_backoff_s:.3f}s",
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": list(self.retryable_codes),
        }
        return json.dumps({"methodConfig": [{"name": [{"service": SERVICE_NAME}], "retryPolicy": policy}]})


#: The policy both clients use unless given another (or None).
DEFAULT_RETRY = RetryPolicy()


def channel_options(user: Sequence[tuple[str, Any]], retry: RetryPolicy | None) -> list[tuple[str, Any]]:
    """The client's defaults, the retry policy, then the caller's options (which win on a clash)."""
    defaults = list(DEFAULT_CHANNEL_OPTIONS)
    if retry is not None:
        defaults += [("grpc.enable_retries", 1), ("grpc.service_config", retry.service_config())]
    else:
        defaults.append(("grpc.enable_retries", 0))
    given = {key for key, _ in user}
    return [(k, v) for k, v in defaults if k not in given] + list(user)


def connection_options(options: Sequence[tuple[str, Any]], index: int) -> list[tuple[str, Any]]:
    """The options of a client's connection number `index` (of `connections=K`).

    gRPC shares one subchannel (one TCP connection) among channels with equal arguments, so K
    plain channels would still be one connection, served by one worker of a `serve --workers N`
    replica (the kernel gives each connection to one worker). A local subchannel pool per channel
    (and an index that makes the arguments differ) makes each its own TCP connection.
    """
    return [*options, ("grpc.use_local_subchannel_pool", 1), ("rollout.connection_index", index)]


#: URL schemes people paste where a gRPC target belongs (gRPC would try to resolve them as a host
#: name and answer UNAVAILABLE "Misformatted domain name" at the first call).
_URL_SCHEMES = ("http", "https", "grpc", "grpcs")
#: gRPC's own name schemes ("dns:///host:port", "unix:/path", ...): passed as they are.
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")


def check_target(target: str) -> str:
    """`target` as a gRPC target (surrounding whitespace dropped), or ValueError saying what is
    wrong: a URL (`http://host:port`) instead of `host:port`, a port that is not a number or not
    0-65535. Checked when the client is made: gRPC itself only fails the first call, after its
    retries and deadline, with a resolver message that does not say what to write instead."""
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"target must be a gRPC target such as 'host:port', got {target!r}")
    text = target.strip()
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() in _URL_SCHEMES:
        hint = " (and tls=True)" if scheme.lower() in ("https", "grpcs") else ""
        raise ValueError(
            f"target {target!r} is a URL; a gRPC target is host:port: {rest.rstrip('/')!r}{hint}"
        )
    if text.startswith(_GRPC_SCHEMES):
        return text
    host, colon, port = text.rpartition(":")
    has_port = colon and not host.endswith(":")  # a bare IPv6 address ("::1") has no port
    if has_port and (not port.isdigit() or int(port) > 65535):
        raise ValueError(f"target {target!r}: the port must be a number 0-65535, got {port!r}")
    return text


def check_connections(connections: int) -> int:
    """`connections` validated: at least 1 (ValueError naming the argument otherwise)."""
    if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
        raise ValueError(f"connections must be an int of at least 1, got {connections!r}")
    return connections


def resolve_timeout(per_call: float | None, client_default: float | None) -> float | None:
    """The deadline of one call: its own, else the client's; `math.inf` means none."""
    value = per_call if per_call is not None else client_default
    return None if value is None or math.isinf(value) else value


def new_request_id() -> str:
    """A fresh request id (what the clients use when none is given)."""
    return uuid.uuid4().hex


def build_request(
    sample: SampleLike, params: ParamsLike, options: OptionsLike, request_id: str | None
) -> pb.GenerateRequest:
    """A GenerateRequest with a request id (generated when not given, so Abort can target it)."""
    return pb.GenerateRequest(
        sample=to_sample(sample),
        sampling_params=to_params(params),
        options=to_options(options),
        request_id=request_id or new_request_id(),
    )


def _is_token_id(value: object) -> bool:
    return isinstance(value, numbers.Integral | np.integer) and not isinstance(value, bool)


def is_batch(value: object) -> bool:
    """Whether `generate` got several samples rather than one.

    One sample: a Sample, a dict, or token ids (a sequence of ints, numpy ints included, or a 1-D
    integer array). A batch: a list or tuple of samples (empty included), or a 2-D integer array.
    """
    if isinstance(value, pb.Sample | Mapping | str | bytes):
        return False
    if isinstance(value, np.ndarray):
        return value.ndim == 2
    if isinstance(value, list | tuple):
        return not value or not _is_token_id(value[0])
    return False


def batch_request_ids(count: int, given: Sequence[str] | None) -> list[str]:
    """One request id per sample of a batch: the caller's, or fresh ones."""
    if given is None:
        return [new_request_id() for _ in range(count)]
    ids = list(given)
    if len(ids) != count:
        raise ValueError(f"request_ids has {len(ids)} ids for {count} samples")
    if len(set(ids)) != len(ids) or not all(ids):
        raise ValueError("request_ids must be distinct and non-empty")
    return ids
