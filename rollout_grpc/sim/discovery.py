"""Liveness and model discovery: ``/health`` and ``/v1/models`` (reference §8, §10.1).

The other discovery routes of vLLM (``/ping``, ``/version``, ``/load``, ``/metrics``, ``/tokenize``,
``/detokenize``) are in ``fidelity.py``: the service never calls them.
"""

from __future__ import annotations

import secrets
import time

from aiohttp import web

from .core import CORE_KEY, EngineCore
from .errors import json_response


def _core(request: web.Request) -> EngineCore:
    core: EngineCore = request.app[CORE_KEY]
    return core


async def health(request: web.Request) -> web.StreamResponse:
    return web.Response(status=503 if _core(request).config.faults.dead else 200)


async def models(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    cfg = core.config
    created = int(time.time())
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": cfg.model,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": cfg.root,
                    "parent": None,
                    "max_model_len": cfg.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{secrets.token_hex(8)}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    )
