"""The simulator's ``/_sim/*`` test routes: faults, stats and synchronisation hooks over HTTP.

Test-side on purpose: they do not exist on vLLM and the service never calls them, so the installed
package does not ship them. A test mounts them on a simulated engine with
``SimEngine(config, extensions=[sim_admin.mount])`` (or ``create_app(..., extensions=[mount])``),
and an engine in its own process gets them from ``python -m tests.support.sim_server`` (or
``processes.start_engine(..., test_routes=True)``). In-process tests can use the same knobs from
Python (``SimEngine.faults``, ``.stats``, ``.wait_for_tokens``); these routes are their HTTP twins,
for an engine whose Python objects a test cannot reach.

* ``GET /_sim/faults`` → the fault state; ``POST /_sim/faults`` merges a JSON object into it
  (``{"reset": true}`` clears everything first); unknown names → 400.
* ``GET /_sim/stats`` → counters (``SimStats.to_dict()`` plus live ``in_flight``/``running``/``held``,
  ``paused``, ``weight_version``); ``POST /_sim/stats/reset`` zeroes them.
* ``POST /_sim/wait`` ``{"request_id": id, "tokens": k}`` → answers once the engine request
  exists and choice 0 has k tokens (or it finished); ``{"running": n}`` / ``{"held": n}`` /
  ``{"in_flight": n}`` → once at least n requests are in that state; ``{"idle": true}`` → once
  nothing is tracked. Optional ``timeout_s`` (default 30) → 408 on expiry.
* ``POST /_sim/config`` ``{"token_delay_s":…, "ttft_s":…, "eos_probability":…}`` → runtime speed/EOS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from rollout_grpc.sim.core import CORE_KEY, EngineCore
from rollout_grpc.sim.errors import ApiError, json_response
from rollout_grpc.sim.request import parse_json_bytes

#: Where the routes live (the prefix vLLM never uses).
PREFIX = "/_sim"


def _core(request: web.Request) -> EngineCore:
    core: EngineCore = request.app[CORE_KEY]
    return core


async def _body(request: web.Request) -> dict[str, Any]:
    data = await request.read()
    obj = parse_json_bytes(data) if data.strip() else {}
    if not isinstance(obj, dict):
        raise ApiError(400, "expected a JSON object", "Bad Request")
    return obj


def stats_dict(core: EngineCore) -> dict[str, Any]:
    d = core.stats.to_dict()
    d.update(
        in_flight=sum(len(v) for v in core.requests.values()),
        running=len(core.running),
        held=len(core.held),
        paused=core.paused,
        frozen=core.frozen,
        weight_version=core.version,
        load=core.load,
    )
    return d


async def get_faults(request: web.Request) -> web.StreamResponse:
    return json_response(_core(request).config.faults.to_dict())


async def post_faults(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    body = await _body(request)
    faults = core.config.faults
    if body.pop("reset", False):
        faults.clear()
    try:
        faults.update(body)
    except (KeyError, TypeError, ValueError) as e:
        raise ApiError(400, f"unknown or invalid fault field: {e}", "Bad Request") from None
    return json_response(faults.to_dict())


async def get_stats(request: web.Request) -> web.StreamResponse:
    return json_response(stats_dict(_core(request)))


async def reset_stats(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    core.reset_stats()
    return json_response(stats_dict(core))


async def post_config(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    body = await _body(request)
    cfg = core.config
    for key in ("token_delay_s", "ttft_s"):
        if key in body:
            setattr(cfg, key, float(body[key]))
    if "eos_probability" in body:
        cfg.eos_probability = float(body["eos_probability"])
        core.lm.set_eos_probability(cfg.eos_probability)
    return json_response(
        {"token_delay_s": cfg.token_delay_s, "ttft_s": cfg.ttft_s, "eos_probability": cfg.eos_probability}
    )


async def wait(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    body = await _body(request)
    timeout = float(body.get("timeout_s", 30.0))

    async def _do() -> None:
        if "request_id" in body:
            await core.wait_for_tokens(str(body["request_id"]), int(body.get("tokens", 0)))
            return
        preds: list[Callable[[], bool]] = []
        if "running" in body:
            n = int(body["running"])
            preds.append(lambda: len(core.running) >= n)
        if "held" in body:
            h = int(body["held"])
            preds.append(lambda: len(core.held) >= h)
        if "in_flight" in body:
            f = int(body["in_flight"])
            preds.append(lambda: sum(len(v) for v in core.requests.values()) >= f)
        if body.get("idle"):
            preds.append(lambda: not core.requests)
        await core.wait_until(lambda: all(p() for p in preds))

    try:
        await asyncio.wait_for(_do(), timeout)
    except TimeoutError:
        return json_response({"ok": False, **stats_dict(core)}, status=408)
    return json_response({"ok": True})


def mount(app: web.Application) -> None:
    """Add the ``/_sim/*`` routes to a simulated engine's app (an ``AppExtension``)."""
    r = app.router
    r.add_get(f"{PREFIX}/faults", get_faults)
    r.add_post(f"{PREFIX}/faults", post_faults)
    r.add_get(f"{PREFIX}/stats", get_stats)
    r.add_post(f"{PREFIX}/stats/reset", reset_stats)
    r.add_post(f"{PREFIX}/config", post_config)
    r.add_post(f"{PREFIX}/wait", wait)
