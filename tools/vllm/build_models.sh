#!/usr/bin/env bash
# Builds the tiny models into .cache/vllm-models/ (needs install.sh first). Idempotent: a stamp with the
# hash of the builder and the pinned packages makes a rerun return at once.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

stamp="$TIER_MODELS/.rollout-built"
want="$(cat "$TIER_TOOLS/build_models.py" "$TIER_TOOLS/constraints.txt" | sha256sum | cut -d' ' -f1)"

mkdir -p "$TIER_CACHE"
exec 9>"$TIER_CACHE/vllm-models.lock"
flock 9

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  tier_log "tiny models up to date ($TIER_MODELS)"
  exit 0
fi

[[ -x "$TIER_VENV/bin/python" ]] || { echo "no vLLM venv; run tools/vllm/install.sh" >&2; exit 1; }
tier_log "building tiny models"
tmp="$TIER_CACHE/vllm-models.tmp"
rm -rf "$tmp"
mkdir -p "$tmp"
env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$tmp/.hf-home" HF_HUB_DISABLE_PROGRESS_BARS=1 \
  PYTHONPATH="$TIER_TOOLS/site" ROLLOUT_VLLM_TORCHVISION=stub PYTHONHASHSEED=0 \
  "$TIER_VENV/bin/python" "$TIER_TOOLS/build_models.py" "$tmp"
rm -rf "$tmp/.hf-home"
echo "$want" >"$tmp/.rollout-built"
rm -rf "$TIER_MODELS"
mv "$tmp" "$TIER_MODELS"
tier_log "tiny models ready"
