# Paths shared by the tools/vllm scripts. Source it; it sets no shell options.
# Everything lives under the project's ignored .cache/ folder unless ROLLOUT_VLLM_CACHE says otherwise.

TIER_TOOLS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$TIER_TOOLS/../.." && pwd)"
TIER_CACHE="${ROLLOUT_VLLM_CACHE:-$REPO_ROOT/.cache}"
TIER_VENV="$TIER_CACHE/vllm-venv"
TIER_MODELS="$TIER_CACHE/vllm-models"
TIER_LOGS="$TIER_CACHE/vllm-logs"
TIER_PYTHON="${ROLLOUT_VLLM_PYTHON:-python3.11}"

# Print a line with elapsed seconds since the calling script started.
tier_log() { printf '[vllm-tier %4ds] %s\n' "$SECONDS" "$*" >&2; }
