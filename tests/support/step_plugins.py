"""A real installed plugin distribution for the RolloutStep plugin tests, and a real HTTP filter.

`installed_plugins(tmp)` writes a tiny distribution (a module and its `.dist-info` with
`entry_points.txt`) into a directory the caller puts on `sys.path`: `importlib.metadata` then finds
its entry points exactly as it finds those of a pip-installed package.

`FilterServer` is an aiohttp app on 127.0.0.1:0 speaking the remote filter's shape: it keeps a
group whose label is "keep". `mode` makes it misbehave: "malformed" answers `{"keep": "yes"}`,
"hang" never answers (the service's timeout ends the call), "error" answers 500.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

MODULE = "rollout_step_plugins_demo"

_SOURCE = '''
"""Step plugins of the tests: a label reward and a label filter, and ones that fail."""

import asyncio


def label_reward(request):
    return {"reward": 1.0 if request.label == "keep" else float(len(request.response) % 2), "by": "plugin"}


async def async_reward(request):
    await asyncio.sleep(0)
    return 0.25


def boom_reward(request):
    raise RuntimeError("the grader exploded")


def text_reward(request):
    return "high"


def label_filter(group):
    assert len(group.responses) == len(group.rewards) == len(group.statuses)
    return True if group.label == "keep" else f"label {group.label!r} is not keep"


def boom_filter(group):
    raise ValueError("the filter exploded")


def none_filter(group):
    return None
'''

_ENTRY_POINTS = f"""[rollout_grpc.step_rewards]
label_reward = {MODULE}:label_reward
async_reward = {MODULE}:async_reward
boom_reward = {MODULE}:boom_reward
text_reward = {MODULE}:text_reward

[rollout_grpc.step_filters]
label_filter = {MODULE}:label_filter
boom_filter = {MODULE}:boom_filter
none_filter = {MODULE}:none_filter
"""


def installed_plugins(root: Path) -> Path:
    """Write the plugin distribution under `root` (put `root` on sys.path); returns `root`."""
    (root / f"{MODULE}.py").write_text(_SOURCE)
    info = root / f"{MODULE}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(_ENTRY_POINTS)
    return root


class FilterServer:
    """`async with FilterServer() as f: f.url ...` (see the module docstring)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.requests: list[dict[str, Any]] = []
        self._never = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _post(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.mode == "hang":
            await self._never.wait()  # never set: the caller's timeout ends the call
        if self.mode == "error":
            return web.Response(status=500, text="filter broke")
        if self.mode == "malformed":
            return web.json_response({"keep": "yes"})
        keep = body["label"] == "keep"
        return web.json_response({"keep": keep, "reason": "" if keep else f"label {body['label']}"})

    async def _get(self, request: web.Request) -> web.Response:
        return web.Response(text="filter")

    async def __aenter__(self) -> FilterServer:
        app = web.Application()
        app.router.add_post("/filter", self._post)
        app.router.add_get("/filter", self._get)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/filter"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._never.set()
        if self._runner is not None:
            await self._runner.cleanup()
