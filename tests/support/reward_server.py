"""A real HTTP reward model for the RolloutStep tests: an aiohttp app on 127.0.0.1:0 speaking
slime's remote_rm shape (`POST {prompt, response, label}` -> a number or an object; a group POSTs
`{prompts, responses, labels}` and gets a list).

The reward is a function of the label, so a test decides which groups the filter keeps:
`"one"` -> 1.0 always (zero std: filtered), `"alternate"` -> 0.0, 1.0, 0.0, ... per label (nonzero
std), `"object"` -> `{"reward": 0.5, "why": "..."}`, `"text"` -> a string (not a number), `"parity"` ->
the parity of the response's characters (a function of the response alone: bench/step.py).
`failing` answers 503 (retried by the service, then the sample's reward fails); `stop()` takes the
server down (connection refused). `connections` counts the TCP connections requests came on (the
replica's keep-alive pool reuses them across steps: rewards/connections.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from aiohttp import web


class RewardServer:
    """`async with RewardServer() as rm: rm.url ...`"""

    def __init__(self, *, per_sample_only: bool = False) -> None:
        #: Answer 400 to the batch shape, as a slime reward server (one sample per POST) would.
        self.per_sample_only = per_sample_only
        self.requests: list[dict[str, Any]] = []
        #: GETs (the service's reachability probe at step start).
        self.probes = 0
        self.failing = False
        #: (host, port) of each client connection a request came on.
        self._peers: set[tuple[str, int]] = set()
        self._seen: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def _reward(self, label: str, response: str = "") -> object:
        if label == "parity":
            return float(sum(map(ord, response)) % 2)
        if label == "alternate":
            value = float(self._seen[label] % 2)
            self._seen[label] += 1
            return value
        if label == "object":
            return {"reward": 0.5, "why": "a detailed verdict"}
        if label == "text":
            return "great answer"
        return 1.0

    @property
    def connections(self) -> int:
        """TCP connections opened to this server so far (each request's client address, counted once)."""
        return len(self._peers)

    def _saw(self, request: web.Request) -> None:
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        if peer is not None:
            self._peers.add((peer[0], peer[1]))

    async def _handle(self, request: web.Request) -> web.Response:
        self._saw(request)
        if self.failing:
            return web.Response(status=503, text="overloaded")
        body = await request.json()
        self.requests.append(body)
        if "responses" in body and self.per_sample_only:
            return web.Response(status=400, text="expected {prompt, response, label}")
        if "responses" in body:
            pairs = zip(body["labels"], body["responses"], strict=True)
            return web.json_response([self._reward(label, response) for label, response in pairs])
        return web.json_response(self._reward(body["label"], body["response"]))

    async def _probe(self, request: web.Request) -> web.Response:
        self._saw(request)
        self.probes += 1
        return web.Response(status=405, text="POST only")

    async def __aenter__(self) -> RewardServer:
        app = web.Application()
        app.router.add_post("/rm", self._handle)
        app.router.add_get("/rm", self._probe)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/rm"
        return self

    async def stop(self) -> None:
        """Take the server down: later requests are refused."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
