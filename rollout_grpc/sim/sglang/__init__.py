"""A simulated SGLang engine: SGLang's native HTTP API (``/generate``, abort, pause/continue,
weight version, discovery) over the simulator's shared engine core and toy model.

Select it with ``SimConfig(kind="sglang")`` (or ``rollout-grpc sim --kind sglang``); its server
arguments are ``SimConfig.sglang`` (``SGLangOptions``). The contract it follows is
``docs/sglang-http-api.md``, a reading of SGLang's source: it has not been compared with a running
SGLang server. It must not import ``rollout_grpc.server``.
"""

from .app import create_sglang_app
from .state import SGLANG_KEY, SGLangState

__all__ = ["SGLANG_KEY", "SGLangState", "create_sglang_app"]
