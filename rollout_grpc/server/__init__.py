"""The rollout service replica (the `server` extra, Python 3.11); see environment.py."""

from rollout_grpc.server.environment import require_server_environment

require_server_environment()
