"""Generate the Python modules for proto/rollout.proto into rollout_grpc/_proto/.

Why a script: protoc names generated imports after the proto's include path, so compiling
`proto/rollout.proto` with `-Iproto` yields a top-level `import rollout_pb2`. Mapping the include
path onto the package (`-Irollout_grpc/_proto=proto`) makes protoc emit package-qualified imports
(`from rollout_grpc._proto import rollout_pb2`) with no post-processing. `--check` regenerates into a
temporary folder and fails when the committed files differ (CI runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = "rollout_grpc/_proto"
BIN = Path(sys.executable).parent  # the mypy-protobuf plugins live beside the interpreter
GENERATED = ("rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py", "rollout_pb2_grpc.pyi")


def generate(out_root: Path) -> None:
    """Run grpcio-tools' bundled protoc with the mypy-protobuf plugins into `out_root`."""
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PACKAGE_DIR}={ROOT / 'proto'}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--plugin=protoc-gen-mypy={BIN / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={BIN / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        f"{PACKAGE_DIR}/rollout.proto",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            name
            for name in GENERATED
            if not (ROOT / PACKAGE_DIR / name).exists()
            or not filecmp.cmp(Path(tmp) / PACKAGE_DIR / name, ROOT / PACKAGE_DIR / name, shallow=False)
        ]
    if stale:
        print(f"generated code is stale, run `make proto`: {', '.join(stale)}", file=sys.stderr)
        return 1
    print("generated code matches proto/rollout.proto")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
