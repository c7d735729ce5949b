"""Drop-ins for trainers' rollout hooks, built on rollout_grpc.client (no server imports)."""
