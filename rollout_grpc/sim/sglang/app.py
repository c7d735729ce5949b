"""The SGLang personality's aiohttp application: SGLang's routes over the shared engine core.

Unregistered routes and wrong methods answer FastAPI's ``{"detail": …}`` 404/405 as SGLang's
FastAPI server does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from ..config import SimConfig
from ..core import CORE_KEY, EngineCore
from ..errors import json_response, not_found_route
from . import control, discovery, weights
from .generate import handle_generate
from .state import SGLANG_KEY, SGLangState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _fastapi_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return not_found_route()
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, status=405)


def create_sglang_app(
    config: SimConfig,
    *,
    core: EngineCore | None = None,
    extensions: Sequence[Callable[[web.Application], None]] = (),
) -> web.Application:
    """Build a simulated SGLang server; ``app[CORE_KEY]`` is the engine core, ``app[SGLANG_KEY]``
    the SGLang state. The core starts at ``config.sglang.weight_version``."""
    app = web.Application(middlewares=[_fastapi_errors], client_max_size=256 * 1024 * 1024)
    core = core if core is not None else EngineCore(config)
    core.update_weight_version(config.sglang.weight_version)
    app[CORE_KEY] = core
    app[SGLANG_KEY] = SGLangState(core)
    r = app.router
    r.add_post("/generate", handle_generate)
    r.add_put("/generate", handle_generate)
    r.add_post("/abort_request", control.abort_request)
    r.add_post("/pause_generation", control.pause_generation)
    r.add_post("/continue_generation", control.continue_generation)
    r.add_post("/update_weight_version", control.update_weight_version)
    r.add_post("/update_weights_from_disk", weights.update_weights_from_disk)
    r.add_post("/init_weights_update_group", weights.init_weights_update_group)
    r.add_post("/update_weights_from_distributed", weights.update_weights_from_distributed)
    for method in ("GET", "POST"):
        r.add_route(method, "/release_memory_occupation", weights.release_memory_occupation)
        r.add_route(method, "/resume_memory_occupation", weights.resume_memory_occupation)
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", control.flush_cache)
    for path in ("/health", "/health_generate"):
        r.add_get(path, discovery.health)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, discovery.model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, discovery.server_info)
    r.add_get("/v1/models", discovery.models)
    r.add_get("/v1/loads", discovery.loads)
    # No /get_load, /get_weight_version or /weight_version: 0.5.23 has none of these routes, so
    # they answer the unknown-route 404 (docs/sglang-http-api.md §6).
    for extend in extensions:
        extend(app)
    return app
