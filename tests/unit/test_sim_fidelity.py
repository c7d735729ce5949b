"""The simulator's fidelity routes are the ones the service never calls.

`rollout_grpc/sim/fidelity.py` holds the vLLM routes kept only so the simulator answers like vLLM
(and the conformance tests can compare it); if the service starts calling one of them, it belongs
with the routes the service uses, and this test says so.
"""

from __future__ import annotations

import ast
from pathlib import Path

from aiohttp import web

import rollout_grpc.server
from rollout_grpc.sim import create_app, fidelity

SERVER = Path(rollout_grpc.server.__file__).parent


def _paths(app: web.Application) -> set[str]:
    return {resource.canonical for resource in app.router.resources()}


def fidelity_paths() -> set[str]:
    app = web.Application()
    fidelity.add_routes(app.router, dev=lambda handler: handler)
    return _paths(app)


def adapter_string_constants() -> set[str]:
    """Every string literal of the vLLM adapter (`engines/vllm/`: the only modules that know vLLM's
    paths; the service's own HTTP routes, such as its `/metrics`, are elsewhere)."""
    adapter = sorted((SERVER / "engines" / "vllm").glob("*.py"))
    assert SERVER / "engines" / "vllm" / "adapter.py" in adapter
    found: set[str] = set()
    for path in adapter:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_the_service_calls_no_fidelity_route() -> None:
    called = fidelity_paths() & adapter_string_constants()
    assert not called, f"the service uses {sorted(called)}: move them out of rollout_grpc/sim/fidelity.py"


def test_the_routes_the_service_calls_are_not_in_fidelity() -> None:
    used = {"/health", "/v1/models", "/server_info", "/pause", "/resume", "/inference/v1/generate"}
    assert used <= _paths(create_app())
    assert not used & fidelity_paths()
    assert {"/tokenize", "/version", "/reset_prefix_cache"} <= fidelity_paths()
