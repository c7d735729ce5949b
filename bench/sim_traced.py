"""`python -m bench.sim_traced`: `rollout-grpc sim` that appends one line per generate request to
the file named by `SIM_TRACE` (when it arrived and when its answer ended, wall clock).

For `bench/step_trace.py`: where a rollout path loses time is read off the engine's side (the same
clock for every path), not off the client's marks, which are different events per path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from rollout_grpc.sim.__main__ import main


def mount(app: web.Application) -> None:
    path = os.environ.get("SIM_TRACE")
    if not path:
        return
    out = open(path, "ab", buffering=0)  # noqa: SIM115  # lives as long as the process

    @web.middleware
    async def trace(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not request.path.endswith("/generate"):
            return await handler(request)
        arrived = time.time()
        body = orjson.loads(await request.read())
        try:
            return await handler(request)
        finally:
            line = {
                "arrived": arrived,
                "ended": time.time(),
                "last_token": body.get("token_ids", [0])[-1],
                "seed": body.get("sampling_params", {}).get("seed"),
            }
            out.write(orjson.dumps(line) + b"\n")

    app.middlewares.append(trace)


if __name__ == "__main__":
    main(prog="python -m bench.sim_traced", extensions=[mount])
