#!/usr/bin/env bash
# buf breaking: is proto/ wire- and source-compatible with the contract trainers already use?
#
# The baseline is the proto as it was before its latest change:
#   * proto/ has uncommitted changes  -> the committed proto (HEAD);
#   * otherwise                       -> the parent of the last commit that changed proto/
#     (so a later docs-only commit does not hide a breaking change made just before it).
# BUF_BREAKING_AGAINST=<git ref> overrides the baseline (e.g. origin/main in a pull-request job).
#
# Then, as well, against the last release: the newest `v*` tag that HEAD contains (by version order;
# docs/releasing.md says how releases are tagged). Trainers pin releases, so a change that is
# compatible with the previous commit but not with the release (e.g. a field added after the release
# and removed again) is still caught. Without such a tag the script says so and checks only the first
# baseline.
#
# The baseline's proto/ is exported with `git archive` into a temporary folder, beside the current
# buf.yaml, so both sides are compiled with the same module layout and rules, and no remote or
# `.git#...` input is needed. Passes, with a message that says why, when there is nothing to
# compare against: the proto's first commit, or a shallow clone whose missing history cannot be
# fetched (the script tries `git fetch --deepen=50` once).
set -euo pipefail
cd "$(dirname "$0")/.."

BUF=${BUF:-.venv/bin/buf}
PROTO_DIR=proto

if ! git rev-parse --verify -q HEAD >/dev/null; then
  echo "buf breaking: skipped, no commit yet (nothing to compare against)"
  exit 0
fi

if [[ -n "${BUF_BREAKING_AGAINST:-}" ]]; then
  base=$BUF_BREAKING_AGAINST
  why="BUF_BREAKING_AGAINST"
elif ! git diff --quiet HEAD -- "$PROTO_DIR"; then
  base=HEAD
  why="uncommitted changes in $PROTO_DIR/"
else
  last=$(git log -1 --format=%H -- "$PROTO_DIR")
  # A shallow clone (CI's default depth 1) may lack the baseline: try to fetch more history once.
  if [[ -n "$last" && "$(git rev-parse --is-shallow-repository)" == "true" ]] \
    && ! git rev-parse --verify -q "$last^" >/dev/null; then
    echo "buf breaking: shallow clone, fetching more history for the baseline"
    if timeout 120 git fetch --quiet --deepen=50 2>/dev/null; then
      last=$(git log -1 --format=%H -- "$PROTO_DIR")
    fi
  fi
  if [[ -z "$last" ]]; then
    echo "buf breaking: skipped, $PROTO_DIR/ has never been committed"
    exit 0
  fi
  # The last commit that touched proto/ has no parent in a shallow clone's history (the graft
  # boundary) or in a repository whose first commit created the proto.
  if ! git rev-parse --verify -q "$last^" >/dev/null; then
    if [[ "$(git rev-parse --is-shallow-repository)" == "true" ]]; then
      echo "buf breaking: skipped, shallow clone: the parent of $(git rev-parse --short "$last")" \
        "(the last change to $PROTO_DIR/) is not in the local history; run \`git fetch --deepen=50\`" \
        "or set BUF_BREAKING_AGAINST=<ref> to check"
    else
      echo "buf breaking: passed, $(git rev-parse --short "$last") created $PROTO_DIR/:" \
        "there is no earlier contract to break"
    fi
    exit 0
  fi
  base="$last^"
  why="parent of $(git rev-parse --short "$last"), the last commit that changed $PROTO_DIR/"
fi

# Compiles the proto/ of commit $1 beside the current buf.yaml and runs buf breaking against it.
check_against() {
  local sha=$1 why=$2 tmp
  if [[ -z "$(git ls-tree -r --name-only "$sha" -- "$PROTO_DIR" | grep '\.proto$' || true)" ]]; then
    echo "buf breaking: passed, $why has no .proto files under $PROTO_DIR/:" \
      "there is no earlier contract to break"
    return 0
  fi
  tmp=$(mktemp -d)
  git archive "$sha" -- "$PROTO_DIR" | tar -x -C "$tmp"
  cp buf.yaml "$tmp/buf.yaml"
  echo "buf breaking: $PROTO_DIR/ against $(git rev-parse --short "$sha") ($why)"
  if ! "$BUF" breaking --against "$tmp"; then
    rm -rf "$tmp"
    return 1
  fi
  rm -rf "$tmp"
  echo "buf breaking: no breaking changes against $why"
}

if ! base_sha=$(git rev-parse --verify -q "$base^{commit}"); then
  echo "buf breaking: baseline $base ($why) is not a commit in this clone" >&2
  exit 2
fi
check_against "$base_sha" "$why"

release=$(git tag --list 'v*' --merged HEAD --sort=-version:refname | head -n 1)
if [[ -z "$release" ]]; then
  echo "buf breaking: no v* release tag in HEAD's history yet; checked against the baseline above only"
elif [[ "$(git rev-parse "$release^{commit}")" == "$base_sha" ]]; then
  echo "buf breaking: the last release $release is the baseline above"
else
  check_against "$(git rev-parse "$release^{commit}")" "release $release"
fi
