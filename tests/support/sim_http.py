"""Small HTTP helpers shared by the simulator tests, the engine-factory type and the golden files."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from rollout_grpc.sim import SimEngine
from tests.support.conformance import parse_sse

#: Real vLLM 0.32 bodies recorded on tiny random-weight models (see its README.md).
GOLDEN_DIR = Path(__file__).resolve().parents[1] / "sim" / "golden"

#: The ``make_engine`` fixture of tests/sim: ``async with make_engine(token_delay_s=0.001) as eng:``.
EngineFactory = Callable[..., contextlib.AbstractAsyncContextManager[SimEngine]]


def golden(name: str) -> dict[str, Any]:
    """One recorded file (``r_dense``, ``r_pause``, ``r_moe``, ``r_vl``), key order preserved."""
    data: dict[str, Any] = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    return data


PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301, 835, 38, 2, 206, 1, 72, 345, 80, 1653, 206]


@dataclass
class Reply:
    status: int
    content_type: str | None
    raw: bytes
    headers: dict[str, str]

    @property
    def json(self) -> Any:
        return orjson.loads(self.raw)

    @property
    def events(self) -> list[Any]:
        return parse_sse(self.raw)


async def call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
) -> Reply:
    kw: dict[str, Any] = {"headers": headers or {}}
    if data is not None:
        kw["data"] = data
    elif body is not None:
        kw["data"] = orjson.dumps(body)
        kw["headers"].setdefault("Content-Type", "application/json")
    async with session.request(method, url, **kw) as r:
        raw = await r.read()
        return Reply(r.status, r.headers.get("Content-Type"), raw, dict(r.headers))


async def post(session: aiohttp.ClientSession, url: str, body: Any = None, **kw: Any) -> Reply:
    return await call(session, "POST", url, body, **kw)


async def get(session: aiohttp.ClientSession, url: str) -> Reply:
    return await call(session, "GET", url)


async def generate(session: aiohttp.ClientSession, base: str, body: dict[str, Any], **kw: Any) -> Reply:
    return await post(session, base + "/inference/v1/generate", body, **kw)


def gen_body(max_tokens: int | None = 8, **sp: Any) -> dict[str, Any]:
    """A generate body on the recorded 20-token prompt; extra kwargs go into sampling_params."""
    params: dict[str, Any] = dict(sp)
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    return {"token_ids": list(PROMPT), "sampling_params": params}
