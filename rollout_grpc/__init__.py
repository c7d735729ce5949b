"""rollout-grpc: a typed gRPC rollout service for RL post-training on vLLM engines."""

__version__ = "0.1.0"
