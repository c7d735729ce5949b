"""A real HTTP environment server for the episode tests: guess the number, over aiohttp on
127.0.0.1:0, speaking the protocol of docs/episodes.md (`POST {episode_id, turn, prompt, label,
action, ...}` -> `{observation | observation_ids, done, reward, info}`).

The game: the label is the secret number. Each model turn's last integer is the guess: right ends
the episode (`done`, reward 1.0); otherwise the observation says "higher" / "lower" (or asks for a
number) with reward 0.0. A model that never guesses right plays until `max_turns`.

`done_after` (or a label `after:N`) ends every episode after that many turns (reward: the sample
index's parity), so a test on the simulator (whose text is random) knows what happens. Faults, from
turn `fail_from` on (earlier turns answer normally, so the episode has turns to keep): `mode` =
"down" (the connection drops without an answer, as when the server dies; `stop()` refuses
connections altogether), "slow" (the answer never comes: the service's timeout ends it),
"malformed" (JSON without `done`), "not_json", "oversize" (a 2 MiB body), "redirect" (302 to
another URL), "flaky" (503 once per (episode, turn), then the answer: the service's retry).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from typing import Any

from aiohttp import web

#: Template glue around an observation (ChatML-like; the environment owns the glue).
GLUE = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def last_int(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


class GuessEnv:
    """`async with GuessEnv() as env: env.url ...`"""

    def __init__(
        self,
        *,
        done_after: int | None = None,
        mode: str = "ok",
        fail_from: int = 0,
        observation_ids: list[int] | None = None,
    ) -> None:
        self.done_after = done_after
        self.mode = mode
        self.fail_from = fail_from
        #: Answer these token ids instead of a text observation.
        self.observation_ids = observation_ids
        self.requests: list[dict[str, Any]] = []
        #: The observation text sent for each (episode_id, turn).
        self.sent: dict[tuple[str, int], str] = {}
        self.probes = 0
        self.slow_waiting = asyncio.Event()
        self._release = asyncio.Event()
        self._flaked: Counter[tuple[str, int]] = Counter()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def observation(self, guess: int | None, secret: int) -> str:
        if guess is None:
            return GLUE.format("Guess a number.")
        return GLUE.format("higher" if guess < secret else "lower")

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        turn, index, label = int(body["turn"]), int(body["sample_index"]), str(body["label"])
        done_after = int(label.removeprefix("after:")) if label.startswith("after:") else self.done_after
        if done_after is not None:
            done = turn + 1 >= done_after
            reward = float(index % 2) if done else 0.0
            reply: dict[str, Any] = {"done": done, "reward": reward, "info": {"turn": turn}}
            if not done:
                if self.observation_ids is not None:
                    reply["observation_ids"] = self.observation_ids
                else:
                    reply["observation"] = GLUE.format(f"turn {turn} seen")
            return reply
        secret = int(body["label"])
        guess = last_int(body["action"])
        if guess == secret:
            return {"done": True, "reward": 1.0, "info": {"guesses": turn + 1}}
        return {"done": False, "reward": 0.0, "observation": self.observation(guess, secret)}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if int(body["turn"]) >= self.fail_from:
            fault = await self._fault(request, body)
            if fault is not None:
                return fault
        answer = self._answer(body)
        self.sent[(str(body["episode_id"]), int(body["turn"]))] = str(answer.get("observation", ""))
        return web.json_response(answer)

    async def _fault(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse | None:
        mode = self.mode
        if mode == "slow":
            self.slow_waiting.set()
            await self._release.wait()
            return web.json_response({"done": True, "reward": 1.0})
        if mode == "down":
            transport = request.transport
            assert transport is not None
            transport.abort()  # the connection drops without an answer, as when the server dies
            return web.Response(status=500)  # written nowhere: the connection is gone
        if mode == "malformed":
            return web.json_response({"observation": "no done here", "reward": 1.0})
        if mode == "not_json":
            return web.Response(text="<html>oops</html>", content_type="text/html")
        if mode == "oversize":
            return web.Response(text=json.dumps({"done": False, "observation": "x" * (2 << 20)}))
        if mode == "redirect":
            raise web.HTTPFound(location="http://127.0.0.1:9/elsewhere")
        if mode == "flaky":
            key = (str(body["episode_id"]), int(body["turn"]))
            self._flaked[key] += 1
            if self._flaked[key] == 1:
                return web.Response(status=503, text="busy")
        return None

    async def _probe(self, request: web.Request) -> web.Response:
        self.probes += 1
        return web.Response(status=405, text="POST only")

    def answers(self, episode_id: str) -> list[dict[str, Any]]:
        """The requests of one episode, in order."""
        return [r for r in self.requests if r["episode_id"] == episode_id]

    async def __aenter__(self) -> GuessEnv:
        app = web.Application()
        app.router.add_post("/env", self._handle)
        app.router.add_get("/env", self._probe)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/env"
        return self

    async def stop(self) -> None:
        """Take the server down: later requests are refused."""
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
