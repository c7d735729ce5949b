"""Generate the Python modules for proto/rollout.proto into rollout_grpc/_proto/.

Why a script: protoc names generated imports after the proto's include path, so compiling
`proto/rollout.proto` with `-Iproto` yields a top-level `import rollout_pb2`. Mapping the include
path onto the package (`-Irollout_grpc/_proto=proto`) makes protoc emit package-qualified imports
(`from rollout_grpc._proto import rollout_pb2`) with no post-processing. `--check` regenerates into a
temporary folder and fails when the committed files differ (CI runs it).

Why the version checks are removed: protoc stamps its own version into the code it writes
(`ValidateProtobufRuntimeVersion(7, 35, 1)` in rollout_pb2.py, `grpcio>=1.85.1` in
rollout_pb2_grpc.py), so the committed code would refuse every older runtime although it uses
nothing newer than protobuf 4.21's `builder` and grpcio 1.62's `_registered_method`. The client runs
inside trainer images that pin protobuf and grpcio through Ray, Megatron and wandb, so the script
deletes exactly those two blocks (failing loudly if protoc's output no longer contains them); the
range the client supports is stated in pyproject.toml and proven by `tools/client_matrix.sh`.
"""

from __future__ import annotations

import argparse
import filecmp
import re
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
    remove_version_checks(out_root)


#: protoc's runtime checks, removed from the generated modules (see the module docstring).
VERSION_CHECKS = {
    "rollout_pb2.py": re.compile(
        r"^from google\.protobuf import runtime_version as _runtime_version\n"
        r"|^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:    .*\n)*?\)\n",
        re.MULTILINE,
    ),
    "rollout_pb2_grpc.py": re.compile(
        r"^GRPC_GENERATED_VERSION = .*\n(?:.*\n)*?^if _version_not_supported:\n(?:    .*\n)*?    \)\n",
        re.MULTILINE,
    ),
}
NOTE = "# Runtime version checks removed by tools/gen_proto.py: see pyproject.toml for the supported range.\n"


def remove_version_checks(out_root: Path) -> None:
    """Delete protoc's runtime version checks from the generated modules (see the module docstring)."""
    for name, pattern in VERSION_CHECKS.items():
        path = out_root / PACKAGE_DIR / name
        text, count = pattern.subn("", path.read_text())
        expected = 2 if name == "rollout_pb2.py" else 1
        if count != expected:
            raise SystemExit(f"{name}: protoc's version check changed shape; update VERSION_CHECKS")
        lines = text.splitlines(keepends=True)
        insert_at = next(i for i, line in enumerate(lines) if not line.startswith("#"))
        lines.insert(insert_at, NOTE)
        path.write_text("".join(lines))


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
