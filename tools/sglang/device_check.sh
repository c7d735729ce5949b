#!/usr/bin/env bash
# SGLang device check: runs issue 39's SGLang scenario checks through a real rollout-grpc replica
# against a real SGLang 0.5.23 on one GPU, and writes a JSON summary (tools/sglang/device_check.py
# documents the checks and the JSON). Exit 0 only when every check passed or was skipped.
#
# Without a GPU (nvidia-smi missing, or `nvidia-smi -L` listing none) it stops at once with one line
# on stderr and exit 2, before installing anything.
#
# Budget on one H100 (< 10 minutes in all; the first run pays the install, later runs reuse the venv):
#   1. venv + `pip install sglang==0.5.23` (wheels, pip cache cold) ....... ~4 min (0 s when present)
#   2. tiny random-weight models (tools/vllm/build_models.py, CPU) ........ ~1 min (0 s when present)
#   3. SGLang start on tiny-llama (no warmup, small KV pool) .............. ~1-2 min
#   4. the checks (tiny model, a few hundred tokens per call) ............. < 1 min
#
# Environment: SGLANG_DEVICE_CHECK_DIR (work dir: venv, models, logs, summary; default
# .cache/sglang-device-check), SGLANG_DEVICE_CHECK_PORT (30000), PYTHON (python3.11), and the repo's
# .venv for the driver (`make venv`).
#
# SGLang flags, each read in 0.5.23's source (arg_groups/arg_utils.py:290 turns field names into
# flags): --enable-deterministic-inference (arg_groups/fields/exec_.py:1153; without it sampling_seed
# is ignored and the replica refuses seeded calls), --incremental-streaming-output
# (arg_groups/fields/serving.py:274; deltas instead of cumulative chunks), --mem-fraction-static
# (arg_groups/fields/schedule.py:27; a small KV pool for a tiny model), --skip-server-warmup
# (arg_groups/fields/serving.py:116).
set -euo pipefail

fail() { echo "device_check: $*" >&2; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 || fail "no GPU: nvidia-smi not found on PATH"
gpus="$(nvidia-smi -L 2>/dev/null || true)"
grep -q '^GPU ' <<<"$gpus" || fail "no GPU: nvidia-smi -L lists none (${gpus:-no output})"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="${SGLANG_DEVICE_CHECK_DIR:-$repo/.cache/sglang-device-check}"
port="${SGLANG_DEVICE_CHECK_PORT:-30000}"
python="${PYTHON:-python3.11}"
driver_python="$repo/.venv/bin/python"
[[ -x "$driver_python" ]] || fail "no $driver_python: run make venv first"
mkdir -p "$work"
log() { echo "[device_check $(date -u +%H:%M:%S)] $*" >&2; }

# 1. SGLang's own venv.
venv="$work/venv"
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c 'import sglang, sys; sys.exit(sglang.__version__ != "0.5.23")'; then
  log "installing sglang==0.5.23 into $venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "sglang==0.5.23"
fi

# 2. The smallest random-weight models, built offline by the project's builder.
models="$work/models"
if [[ ! -f "$models/tiny-llama/config.json" ]]; then
  log "building tiny models into $models"
  rm -rf "$models.tmp" && mkdir -p "$models.tmp"
  env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$models.tmp/.hf-home" PYTHONHASHSEED=0 \
    PYTHONPATH="$repo/tools/vllm/site" ROLLOUT_VLLM_TORCHVISION=stub \
    "$venv/bin/python" "$repo/tools/vllm/build_models.py" "$models.tmp"
  rm -rf "$models.tmp/.hf-home" "$models" && mv "$models.tmp" "$models"
fi

# 3. SGLang on tiny-llama, stopped by its PID on exit.
log "starting SGLang on port $port"
"$venv/bin/python" -m sglang.launch_server --model-path "$models/tiny-llama" --host 127.0.0.1 --port "$port" \
  --enable-deterministic-inference --incremental-streaming-output --mem-fraction-static 0.2 \
  --skip-server-warmup >"$work/sglang.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  kill -0 "$server" 2>/dev/null || { tail -n 40 "$work/sglang.log" >&2; fail "SGLang exited while starting (log: $work/sglang.log)"; }
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  sleep 1
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || fail "SGLang not healthy after 300 s (log: $work/sglang.log)"

# 4. The checks, through a real replica.
log "running the checks"
cd "$repo"
"$driver_python" tools/sglang/device_check.py --engine-url "http://127.0.0.1:$port" --out "$work/summary.json"
