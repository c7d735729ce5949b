#!/usr/bin/env bash
# Unpacks the Python source of the released sglang 0.5.23 wheel, the reading docs/sglang-http-api.md
# cites file by file and line by line, so tests/unit/test_sglang_doc_citations.py can check that
# every cited line exists and holds the identifier the document names there.
#
# Source only: `pip download --no-deps` (no install, no CUDA, nothing imported or run), then the
# `sglang/srt` and `sglang/api` Python files of the wheel (~40 MB on disk). pip checks the wheel
# against the index's sha256. Idempotent: a complete unpack (the stamp file) is kept.
#
# Target: $ROLLOUT_SGLANG_SRC if set, else .cache/sglang-0.5.23 in the repository (what the test
# reads by default). .ci/run calls this before `make test`.
set -euo pipefail

version=0.5.23
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target="${ROLLOUT_SGLANG_SRC:-$repo/.cache/sglang-$version}"
stamp="$target/.unpacked-$version"
python="${PYTHON:-python3.11}"  # the wheel is cp311 (manylinux x86_64)

if [[ -f "$stamp" ]]; then
  echo "fetch_source: sglang $version source already at $target"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: --dest "$tmp" "sglang==$version"
wheel=("$tmp"/sglang-"$version"-*.whl)
[[ -f "${wheel[0]}" ]] || { echo "fetch_source: no sglang-$version wheel downloaded" >&2; exit 1; }

rm -rf "$target.tmp" && mkdir -p "$target.tmp"
"$python" - "${wheel[0]}" "$target.tmp" <<'EOF'
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith(".py") and n.startswith(("sglang/srt/", "sglang/api/"))]
    z.extractall(dest, names)
print(f"fetch_source: {len(names)} files from {wheel.rsplit('/', 1)[-1]}")
EOF
rm -rf "$target" && mv "$target.tmp" "$target"
touch "$stamp"
echo "fetch_source: sglang $version source at $target"
