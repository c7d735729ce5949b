"""The aiohttp application: routes, vLLM's gating switches and error mapping.

Gating mirrors vLLM: without ``scale_out`` the scale-out routes still exist but answer 403
``PermissionDeniedError``; without ``dev_mode`` the development routes are not registered at all
(FastAPI's ``{"detail":"Not Found"}`` 404).
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from . import chat, control, discovery, fidelity, render, weights
from .config import SimConfig
from .core import CORE_KEY, EngineCore
from .errors import SCALE_OUT_DISABLED, ApiError, not_found_route
from .generate import handle_generate

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Adds routes (or state) to a freshly built app before it serves; how a test suite mounts its own
#: simulator-only routes (``tests/support/sim_admin.py``) without shipping them in the package.
AppExtension = Callable[[web.Application], None]

#: The headers of the latest requests to the scale-out routes (``/inference/...``), newest last, as
#: (path, headers) pairs: lets tests check what a client sent (e.g. W3C ``traceparent``).
RECEIVED_HEADERS = web.AppKey("received_headers", collections.deque)


@web.middleware
async def _record_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith("/inference/"):
        request.app[RECEIVED_HEADERS].append((request.path, dict(request.headers)))
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPNotFound:
        return not_found_route()
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def _scale_out(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        core: EngineCore = request.app[CORE_KEY]
        if not core.config.scale_out and not core.config.tokens_only:
            return SCALE_OUT_DISABLED.response()
        return await handler(request)

    return wrapped


def _dev(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        core: EngineCore = request.app[CORE_KEY]
        if not core.config.dev_mode:
            return not_found_route()
        return await handler(request)

    return wrapped


async def _abort_requests(request: web.Request) -> web.StreamResponse:
    """The dev router's ``/abort_requests``; on ``--tokens-only`` without dev mode vLLM mounts the
    scale-out abort at this path instead."""
    cfg = request.app[CORE_KEY].config
    if cfg.dev_mode:
        return await control.dev_abort(request)
    if cfg.tokens_only:
        return await control.scaleout_abort(request)
    return not_found_route()


def create_app(
    config: SimConfig | None = None,
    *,
    core: EngineCore | None = None,
    extensions: Sequence[AppExtension] = (),
) -> web.Application:
    """Build the simulated engine's app. ``app[CORE_KEY]`` is its ``EngineCore``.

    Only vLLM's routes are registered; each of ``extensions`` is then called with the app (the
    error middleware covers the routes it adds). ``config.kind == "sglang"`` builds the SGLang
    personality instead (``rollout_grpc/sim/sglang/``).
    """
    cfg = config if config is not None else SimConfig()
    if cfg.kind == "sglang":
        from .sglang import create_sglang_app

        return create_sglang_app(cfg, core=core, extensions=extensions)
    app = web.Application(middlewares=[_record_headers, _errors], client_max_size=256 * 1024 * 1024)
    app[RECEIVED_HEADERS] = collections.deque(maxlen=64)
    app[CORE_KEY] = core if core is not None else EngineCore(cfg)
    r = app.router
    # discovery
    r.add_get("/health", discovery.health)
    r.add_get("/v1/models", discovery.models)
    # scale-out (403 when disabled)
    r.add_post("/inference/v1/generate", _scale_out(handle_generate))
    r.add_post("/inference/v1/abort_requests", _scale_out(control.scaleout_abort))
    r.add_post("/v1/chat/completions/render", _scale_out(render.chat_render))
    r.add_post("/v1/chat/completions", chat.chat_completions)
    r.add_post("/v1/completions/render", _scale_out(render.completions_render))
    # development router (404 when dev mode is off)
    dev: list[tuple[str, str, Handler]] = [
        ("POST", "/pause", control.pause),
        ("POST", "/resume", control.resume),
        ("GET", "/is_paused", control.is_paused),
        ("POST", "/update_weight_version", control.update_weight_version),
        ("GET", "/weight_info", control.weight_info),
        ("POST", "/reset_mm_cache", control.reset_mm_cache),
        ("GET", "/server_info", control.server_info),
        ("POST", "/collective_rpc", weights.collective_rpc),
        ("POST", "/sleep", weights.sleep),
        ("POST", "/wake_up", weights.wake_up),
        ("GET", "/is_sleeping", weights.is_sleeping),
        ("GET", "/get_world_size", weights.get_world_size),
        ("POST", "/init_weight_transfer_engine", weights.init_weight_transfer_engine),
        ("POST", "/start_weight_update", weights.start_weight_update),
        ("POST", "/update_weights", weights.update_weights),
        ("POST", "/finish_weight_update", weights.finish_weight_update),
    ]
    for method, path, handler in dev:
        r.add_route(method, path, _dev(handler))
    r.add_post("/abort_requests", _abort_requests)
    # the rest of vLLM's surface, which the service never calls
    fidelity.add_routes(r, dev=_dev)
    for extend in extensions:
        extend(app)
    return app
