"""Python clients of rollout.v1.RolloutService (generated code + grpc only; no server imports)."""

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.aio import AsyncRolloutClient
from rollout_grpc.client.channel import RetryPolicy, new_request_id
from rollout_grpc.client.errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    EngineErrors,
    FailedPreconditionError,
    FieldViolation,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    RolloutError,
    UnauthenticatedError,
    UnavailableError,
)
from rollout_grpc.client.samples import (
    chat_messages,
    image_part,
    make_sample,
    routed_experts_array,
    routed_experts_message,
    token_ids,
)
from rollout_grpc.client.step import prompt_group
from rollout_grpc.client.sync import RolloutClient

__all__ = [
    "AbortedError",
    "AsyncRolloutClient",
    "CancelledError",
    "DeadlineExceededError",
    "EngineErrors",
    "FailedPreconditionError",
    "FieldViolation",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "RetryPolicy",
    "RolloutClient",
    "RolloutError",
    "UnauthenticatedError",
    "UnavailableError",
    "chat_messages",
    "image_part",
    "make_sample",
    "new_request_id",
    "pb",
    "prompt_group",
    "routed_experts_array",
    "routed_experts_message",
    "token_ids",
]
