"""Fleet control talks to its neighbours (the Rollout, the engine pool and its handles, the
in-flight registry) through their public methods only (issue 35): no private attribute of another
object is read, and no attribute of another object is written but the fields of control's own
result values (an engine's weight version or model goes through `EnginePool.relabel` /
`EnginePool.name_model`). The rest of the rollout room, and the facade, hold to the second half
for the engines room: they write no field of the engine pool or of its handles (an engine call's
final weight version, the labels a weight update reads or sets, all go through
`EnginePool.relabel`), and a Rollout's Abort{mine} windows are its own (control and a running
step reach them through `Rollout.begin_owner_abort` / `end_owner_abort` / `watch_owner_aborts`)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import rollout_grpc.server.facade as facade_room
import rollout_grpc.server.rollout as rollout_room
from rollout_grpc.server.engines.pool import EngineHandle, EnginePool
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.engine_fanout import FleetResult
from rollout_grpc.server.rollout.fanout import AbortResult, ForwardedAbort
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.inflight import InFlightRegistry
from rollout_grpc.server.rollout.owner_abort import OwnerAborts

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


def _engine_fields() -> set[str]:
    """The fields of the engines room's objects the rollout holds: a handle's, and the pool's
    public attributes."""
    pool = EnginePool([], lambda url: None)  # type: ignore[arg-type,return-value]
    public = {name for name in vars(pool) if not name.startswith("_")}
    return {f.name for f in dataclasses.fields(EngineHandle)} | public


def _own_names(paths: list[Path]) -> set[str]:
    """The attribute names the modules' own classes declare (annotated in a class body, or set
    on `self`): a write of one of these is ambiguous by name alone."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names |= {
                    n.target.id
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return names


def _names_an_engine(receiver: ast.expr) -> bool:
    """The written object is, by its name, an engine handle or the pool (`engine`,
    `attempt.engine`, `self._pool`, `handle`, ...)."""
    last = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
    return any(word in last.lower() for word in ("engine", "handle", "pool"))


def _engine_writes(paths: list[Path], root: Path) -> list[str]:
    fields = _engine_fields()
    ambiguous = fields & _own_names(paths)  # e.g. `in_flight`, also a step counter's field
    found: list[str] = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)):
                continue
            if node.attr not in fields or not _not_self(node.value):
                continue
            if node.attr not in ambiguous or _names_an_engine(node.value):
                found.append(f"{path.relative_to(root)}:{node.lineno} writes {ast.unparse(node)}")
    return found


def test_the_rollout_room_and_the_facade_write_no_field_of_the_engine_pool_or_its_handles() -> None:
    root = Path(rollout_room.__file__).parent.parent
    paths = sorted(Path(rollout_room.__file__).parent.rglob("*.py"))
    paths += sorted(Path(facade_room.__file__).parent.rglob("*.py"))
    violations = _engine_writes(paths, root)
    assert not violations, violations


def test_the_engine_write_check_reports_a_write(tmp_path: Path) -> None:
    """The check above sees a handle's field written under any name, and an ambiguous field
    written on an engine."""
    probe = tmp_path / "_engine_write_probe.py"
    probe.write_text(
        "def f(attempt, entry, counters):\n"
        "    attempt.engine.weight_version = 'v'\n"
        "    entry.engine.in_flight += 1\n"
        "    counters.in_flight = 3\n"
        "class C:\n"
        "    in_flight: int = 0\n"
    )
    found = _engine_writes([probe], tmp_path)
    assert found == [
        "_engine_write_probe.py:2 writes attempt.engine.weight_version",
        "_engine_write_probe.py:3 writes entry.engine.in_flight",
    ], found


def test_a_rollouts_owner_abort_windows_are_private() -> None:
    """Control opens and closes them, a running step watches them, through `Rollout`'s methods:
    no public attribute of a Rollout hands out its `OwnerAborts`."""
    pool = EnginePool([], lambda url: None)  # type: ignore[arg-type,return-value]
    rollout = Rollout(pool, Admission(1, 1), InFlightRegistry())
    public = [k for k, v in vars(rollout).items() if isinstance(v, OwnerAborts) and not k.startswith("_")]
    assert not public, public
    heard: list[str] = []
    unwatch = rollout.watch_owner_aborts("t", lambda: heard.append("t"))
    rollout.begin_owner_abort("t")
    assert rollout.owner_aborting("t") and heard == ["t"]
    rollout.end_owner_abort("t")
    unwatch()
    assert not rollout.owner_aborting("t")
