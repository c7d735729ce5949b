"""Fleet control talks to its neighbours (the Rollout, the engine pool and its handles, the
in-flight registry) through their public methods only (issue 35): no private attribute of another
object is read, and no attribute of another object is written but the fields of control's own
result values (an engine's weight version or model goes through `EnginePool.relabel` /
`EnginePool.name_model`)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import rollout_grpc.server.rollout as rollout_room
from rollout_grpc.server.rollout.engine_fanout import FleetResult
from rollout_grpc.server.rollout.fanout import AbortResult, ForwardedAbort

MODULES = ["control.py", "fanout.py", "engine_fanout.py", "resumes.py"]
#: Fields of fleet control's own result values, which it fills in as it goes.
OWN_VALUES = {
    f.name for value in (AbortResult, ForwardedAbort, FleetResult) for f in dataclasses.fields(value)
}


def _not_self(node: ast.expr) -> bool:
    return not (isinstance(node, ast.Name) and node.id in {"self", "cls"})


def _violations(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _not_self(node.value):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if private:
                found.append(f"{path.name}:{node.lineno} reads .{node.attr}")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                t
                for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and _not_self(target.value)
                and target.attr not in OWN_VALUES
            ):
                found.append(f"{path.name}:{target.lineno} writes .{target.attr}")
    return found


def test_fleet_control_uses_its_neighbours_public_methods_only() -> None:
    room = Path(rollout_room.__file__).parent
    violations = [v for module in MODULES for v in _violations(room / module)]
    assert not violations, violations
