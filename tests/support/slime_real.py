"""slime's own code at a pinned commit, read from a checkout named by `SLIME_SRC` (never vendored).

The tests were written against THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515. slime itself
needs torch and its trainer stack, so what the drop-in must agree with is read without importing
slime: the signatures and dataclass fields are read from the source with `ast`, and modules that
need only the standard library (`slime/utils/eval_config.py`) are loaded from their file. Without
`SLIME_SRC` the callers skip (slime is not a dependency of this project).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

PINNED = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


def root() -> Path | None:
    """The slime checkout, or None."""
    value = os.environ.get("SLIME_SRC")
    if not value or not (Path(value) / "slime" / "rollout" / "sglang_rollout.py").is_file():
        return None
    return Path(value)


def _tree(relative: str) -> ast.Module:
    base = root()
    assert base is not None
    return ast.parse((base / relative).read_text())


def function_parameters(relative: str, name: str) -> list[tuple[str, object]]:
    """(name, default or `...` when none) of a module-level function's parameters."""
    for node in _tree(relative).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            positional = node.args.args
            defaults: list[object] = [...] * (len(positional) - len(node.args.defaults))
            defaults += [ast.literal_eval(d) for d in node.args.defaults]
            return [(a.arg, d) for a, d in zip(positional, defaults, strict=True)]
    raise LookupError(f"{relative} has no function {name}")


def dataclass_fields(relative: str, name: str) -> list[str]:
    """The annotated fields of a class, in order."""
    for node in _tree(relative).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
    raise LookupError(f"{relative} has no class {name}")


def load_file(relative: str, name: str) -> ModuleType:
    """A slime module that needs only the standard library, loaded from its file."""
    if name in sys.modules:
        return sys.modules[name]
    base = root()
    assert base is not None
    spec = importlib.util.spec_from_file_location(name, base / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
