#!/usr/bin/env bash
# The client on every supported interpreter and at both ends of its protobuf/grpcio range.
#
# For each Python (3.10, 3.11, 3.12, 3.13) and each dependency set (oldest, newest): a virtualenv with
# ONLY the client installed (the wheel built from this tree, no [server] extra) runs tests/client
# against a live replica on simulated engines (started by tools/serve_sim.sh from the dev
# virtualenv; one per combination). Virtualenvs are kept in .cache/client-matrix and reused: each run reinstalls the
# fresh wheel, re-applies the pins (the newest set re-resolves against the index) and checks that
# no server dependency crept in. MATRIX_JOBS (default 2) combinations run at once.
# Under CI=true a missing interpreter is a failure; otherwise it is skipped with a warning.
# Usage: tools/client_matrix.sh [3.10 3.12 ...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
read -r -a PYTHONS <<<"${*:-3.10 3.11 3.12 3.13}"
WORK="$ROOT/.cache/client-matrix"
JOBS="${MATRIX_JOBS:-2}"
TEST_DEPS=(pytest pytest-asyncio pytest-timeout)

# The oldest supported versions (pyproject.toml): grpcio has no cp313 wheel before 1.66.2 and
# numpy none before 2.1, so Python 3.13's oldest set starts there.
oldest_pins() {
  case "$1" in
    3.13) echo "protobuf==4.21.12 grpcio==1.66.2 numpy==2.1.3" ;;
    *) echo "protobuf==4.21.12 grpcio==1.62.2 numpy==1.26.4" ;;
  esac
}

find_python() {
  local version="$1" candidate
  for candidate in "$HOME"/.pyenv/versions/"$version".*/bin/python "$(command -v "python$version" || true)"; do
    if [[ -n "$candidate" && -x "$candidate" ]]; then echo "$candidate"; return 0; fi
  done
  return 1
}

# A replica of its own for one combination (parallel combinations must not abort or pause each
# other's generations); sets TARGET, METRICS (its Prometheus host:port) and SERVER_PID.
start_server() {
  local port_file="$1"
  rm -f "$port_file"
  bash tools/serve_sim.sh "$port_file" &
  SERVER_PID=$!
  for _ in $(seq 600); do
    [[ -s "$port_file" ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the replica did not start"; return 1; }
    read -r -t 0.1 <> <(:) || true  # bounded wait for the port file, the replica's readiness signal
  done
  [[ -s "$port_file" ]] || { echo "the replica wrote no port file"; return 1; }
  TARGET="127.0.0.1:$(.venv/bin/python -c 'import json,sys; print(json.load(open(sys.argv[1]))["grpc"])' "$port_file")"
  METRICS="127.0.0.1:$(.venv/bin/python -c 'import json,sys; print(json.load(open(sys.argv[1]))["metrics"])' "$port_file")"
}

# One combination: prints its report to its log; exit status 0 = passed.
run_combo() {
  local version="$1" set="$2" python="$3" venv="$WORK/py$1-$2" pins versions serve_out
  if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c 'import sys; sys.exit(0)' 2>/dev/null; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
  fi
  if [[ $set == oldest ]]; then
    read -r -a pins <<<"$(oldest_pins "$version")"
  else
    pins=(--upgrade protobuf grpcio numpy)
  fi
  "$venv/bin/python" -m pip uninstall -q -y rollout-grpc 2>/dev/null || true
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$WHEEL" "${pins[@]}" "${TEST_DEPS[@]}" \
    2> >(grep -v "^WARNING: Location" >&2)
  versions=$("$venv/bin/python" -c 'import sys, google.protobuf as p, grpc, numpy
print(f"python {sys.version.split()[0]} protobuf {p.__version__} grpcio {grpc.__version__} numpy {numpy.__version__}")')
  echo "== $set: $versions"
  if "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("aiohttp") is None)'; then
    echo "FAIL: the client install holds aiohttp (a server dependency)"; return 1
  fi
  # The console script exists in a client-only install; `serve` must say what to install (and
  # tests/client/test_cli.py checks that --help, --version and info work there).
  if serve_out=$("$venv/bin/rollout-grpc" serve 2>&1) || [[ "$serve_out" != *"rollout-grpc[server]"* ]]; then
    echo "FAIL: rollout-grpc serve without the server extra did not explain itself: $serve_out"; return 1
  fi
  start_server "$WORK/py$version-$set.server.json"
  trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT
  # ROLLOUT_CLIENT_SITE: tests/client/conftest.py fails the session unless the wheel is what they import.
  ROLLOUT_CLIENT_SITE="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    ROLLOUT_CLIENT_MATRIX=1 ROLLOUT_GRPC_TARGET="$TARGET" ROLLOUT_GRPC_METRICS="$METRICS" "$venv/bin/pytest" -q -p no:cacheprovider \
    -W ignore::DeprecationWarning --import-mode=importlib --confcutdir=tests/client tests/client
}

start=$(date +%s)
mkdir -p "$WORK"
rm -f "$WORK"/*.whl "$WORK"/*.log
.venv/bin/python -m pip wheel -q --no-deps -w "$WORK" . 2>&1 | grep -v "^WARNING: Location" || true
WHEEL=$(ls "$WORK"/rollout_grpc-*.whl)

failures=()
declare -A pids=()
for version in "${PYTHONS[@]}"; do
  if ! python=$(find_python "$version"); then
    if [[ "${CI:-}" == "true" ]]; then failures+=("python$version missing"); else echo "SKIP python$version: not found"; fi
    continue
  fi
  for set in oldest newest; do
    while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || true; done
    (run_combo "$version" "$set" "$python") >"$WORK/py$version-$set.log" 2>&1 &
    pids["$version/$set"]=$!
  done
done
for combo in $(printf '%s\n' "${!pids[@]}" | sort); do
  status=0
  wait "${pids[$combo]}" || status=$?
  echo "---- python $combo"
  grep -E "^== |passed|failed|FAIL|Error" "$WORK/py${combo/\//-}.log" || true
  if ((status != 0)); then
    cat "$WORK/py${combo/\//-}.log"
    failures+=("$combo")
  fi
done

echo "client matrix: $(( $(date +%s) - start )) s"
if ((${#failures[@]})); then
  printf 'FAILED: %s\n' "${failures[@]}"
  exit 1
fi
echo "client matrix passed: Python ${PYTHONS[*]} x {oldest, newest}"
