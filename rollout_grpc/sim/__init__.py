"""A simulated vLLM 0.32 engine: the embedded default engine and the test double.

It speaks the HTTP surface a token-in/token-out RL client uses (``/inference/v1/generate`` JSON
and SSE, abort, pause/resume, weight versions, routed experts, render and multimodal features,
discovery and metrics) with vLLM's exact bodies, on top of a deterministic toy model. See
``docs/vllm-http-api.md`` §10 for the contract; "reference §N" in this package's docstrings
means section N of that document.

Public API::

    from rollout_grpc.sim import SimConfig, SimEngine, create_app

    async with SimEngine(SimConfig(token_delay_s=0.001)) as eng:
        ...  # POST f"{eng.url}/inference/v1/generate"

The simulator imports only aiohttp, numpy, orjson, pillow and the standard library.
"""

from .app import create_app
from .config import PERSISTENT, FaultConfig, SimConfig
from .core import EngineCore, SimStats
from .engine import SimEngine

__all__ = ["PERSISTENT", "EngineCore", "FaultConfig", "SimConfig", "SimEngine", "SimStats", "create_app"]
