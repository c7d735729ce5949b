"""slime's own rule rewards, loaded from a slime checkout named by `SLIME_SRC` (never vendored).

`SLIME_SRC` is the root of a THUDM/slime checkout (the tests were written against commit
624b824a898ab0ec1fcb4d373004c7f3852bf515). Only the grader files of `slime/rollout/rm_hub/` are
loaded, as modules of a stand-in package, so slime's package `__init__` (which imports its trainer
stack) is not run. `load()` returns None when `SLIME_SRC` is unset or lacks those files.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

PACKAGE = "_slime_rm_hub"
FILES = ("math_utils", "math_dapo_utils", "deepscaler", "f1", "gpqa")


def load() -> dict[str, Any] | None:
    """slime's grader modules by file name, or None without a usable `SLIME_SRC`."""
    root = os.environ.get("SLIME_SRC")
    if not root:
        return None
    hub = Path(root) / "slime" / "rollout" / "rm_hub"
    if not all((hub / f"{name}.py").is_file() for name in FILES):
        return None
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(hub)]
        sys.modules[PACKAGE] = package
    modules = {}
    for name in FILES:
        full = f"{PACKAGE}.{name}"
        if full not in sys.modules:
            spec = importlib.util.spec_from_file_location(full, hub / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module
            spec.loader.exec_module(module)
        modules[name] = sys.modules[full]
    return modules
