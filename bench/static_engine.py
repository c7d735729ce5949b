"""An engine that costs ~no CPU: nginx serving responses recorded from the simulated vLLM engine.

Why: on a small machine the simulated engines (Python, ~45 s CPU per million tokens) take the
cores a `serve --workers N` replica is meant to use, so a throughput comparison of worker counts
measures the engines. nginx answering every call with a static file (sendfile, no Python) leaves
the cores to the service and the load generator.

What is recorded (`record`), from a running simulator, with the bodies the service sends:

* the routes the service calls at start and every few seconds (`GET /health`, `GET /v1/models`,
  `GET /is_paused`, `GET /server_info?config_format=json`, `POST /inference/v1/abort_requests`);
* ONE `POST /inference/v1/generate` SSE stream of `max_tokens` tokens with per-token logprobs
  (`logprobs: 0`, token ids, `stream_interval` as the service asks once it measured the engine's
  speed), ending with the usage chunk and `[DONE]`.

Every generate call then gets that same stream at once (a 0 ms/token engine): the service does
not compare the engine's `request_id` with its own, and takes the token count from the stream.
The caller must ask for exactly `max_tokens` new tokens with `ignore_eos` (the bench does).
nginx's static module answers only GET/HEAD, so `error_page 405 =200 $uri` turns a POST into an
internal GET of the same file.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pwd
import random
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from bench import load, procs
from tests.support.processes import Proc, free_listen_port, tcp_accepts, wait_until

#: (method, path with query, file under the root, JSON body) of each probed route.
PROBES: tuple[tuple[str, str, str, object], ...] = (
    ("GET", "/health", "health", None),
    ("GET", "/v1/models", "v1/models", None),
    ("GET", "/is_paused", "is_paused", None),
    ("GET", "/server_info?config_format=json", "server_info", None),
    ("POST", "/inference/v1/abort_requests", "inference/v1/abort_requests", {"request_ids": []}),
)
GENERATE = "inference/v1/generate"


def generate_body(max_tokens: int, stream_interval: int) -> dict[str, object]:
    """The body `VllmEngine.generate_body` sends for the bench's request (`load.grpc_request_parts`:
    temperature 1, ignore_eos, skip_text, no top logprobs), once the engine's speed is measured."""
    return {
        "request_id": "recorded-0",
        "token_ids": load.prompt(random.Random(0)),
        "sampling_params": {
            "temperature": 1.0,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "spaces_between_special_tokens": False,
            "logprobs": 0,
            "max_tokens": max_tokens,
            "stream_interval": stream_interval,
        },
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def record(engine_url: str, root: Path, max_tokens: int, stream_interval: int) -> int:
    """Write every probed route's body and one generate stream under `root`; the stream's events."""
    async with aiohttp.ClientSession() as session:
        for method, path, name, body in PROBES:
            async with session.request(method, engine_url + path, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{method} {path}: HTTP {resp.status}")
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_bytes(await resp.read())
        gen = generate_body(max_tokens, stream_interval)
        async with session.post(f"{engine_url}/{GENERATE}", json=gen) as resp:
            if resp.status != 200:
                raise RuntimeError(f"POST /{GENERATE}: HTTP {resp.status}: {await resp.text()}")
            stream = await resp.read()
    (root / GENERATE).parent.mkdir(parents=True, exist_ok=True)
    (root / GENERATE).write_bytes(stream)
    events = [line for line in stream.split(b"\n") if line.startswith(b"data: ")]
    tokens = sum(
        len(choice.get("token_ids") or [])
        for line in events
        if line != b"data: [DONE]"
        for choice in json.loads(line[6:]).get("choices", [])
    )
    if tokens != max_tokens or events[-1] != b"data: [DONE]":
        raise RuntimeError(f"recorded stream has {tokens} tokens (want {max_tokens}) or no [DONE]")
    return len(events)


def nginx_config(root: Path, ports: list[int], workers: int) -> str:
    """One nginx serving `root` on every port in `ports` (one port per engine URL)."""
    servers = "\n".join(
        f"""    server {{
        listen 127.0.0.1:{port} backlog=4096;
        root {root};
        default_type application/json;
        error_page 405 =200 $uri;
        location = /{GENERATE} {{ default_type text/event-stream; }}
    }}"""
        for port in ports
    )
    # As root, nginx workers would run as `nobody`, who may not traverse a private temp directory
    # (pytest's); they run as the master's user, as they do when nginx is started unprivileged.
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes {workers};
daemon off;
pid nginx.pid;
error_log nginx-error.log warn;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    sendfile on;
    tcp_nodelay on;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    client_body_buffer_size 64k;
    client_body_temp_path client_body_temp;
    proxy_temp_path proxy_temp;
    fastcgi_temp_path fastcgi_temp;
    uwsgi_temp_path uwsgi_temp;
    scgi_temp_path scgi_temp;
{servers}
}}
"""


@dataclass
class StaticEngines:
    """nginx serving the recorded engine on `urls`; `pids` are its master and worker processes."""

    proc: Proc
    urls: list[str]
    pids: list[int]


def start(
    group: procs.Processes,
    engines: int = 2,
    max_tokens: int = 256,
    stream_interval: int = 16,
    nginx_workers: int = 1,
    name: str = "static",
) -> StaticEngines:
    """Record from a simulated engine (stopped afterwards), then serve the recording with nginx."""
    binary = procs.nginx_binary()
    if binary is None:
        raise procs.StartupError("no nginx binary on this machine")
    prefix = group.workdir / name
    root = prefix / "root"
    root.mkdir(parents=True, exist_ok=True)
    sim = procs.start_sim(group, f"{name}-recorder", 0.0, seed=0)
    try:
        asyncio.run(record(sim.url, root, max_tokens, stream_interval))
    finally:
        sim.proc.popen.terminate()
        sim.proc.popen.wait(30)
    rng = random.Random()
    ports = [free_listen_port(rng) for _ in range(engines)]
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_config(root, ports, nginx_workers))
    proc = group.start(f"{name}-nginx", [binary, "-e", "stderr", "-p", f"{prefix}/", "-c", str(conf)])
    for port in ports:
        wait_until(f"nginx on port {port}", functools.partial(tcp_accepts, port), proc)
    pids = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children()]
    return StaticEngines(proc, [f"http://127.0.0.1:{port}" for port in ports], pids)
