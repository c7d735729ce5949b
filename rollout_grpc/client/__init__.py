"""Python clients of rollout.v1.RolloutService (generated code + grpc only; no server imports)."""

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.aio import AsyncRolloutClient
from rollout_grpc.client.errors import EngineErrors
from rollout_grpc.client.samples import (
    chat_messages,
    image_part,
    make_sample,
    routed_experts_array,
    routed_experts_message,
)
from rollout_grpc.client.sync import RolloutClient

__all__ = [
    "AsyncRolloutClient",
    "EngineErrors",
    "RolloutClient",
    "chat_messages",
    "image_part",
    "make_sample",
    "pb",
    "routed_experts_array",
    "routed_experts_message",
]
