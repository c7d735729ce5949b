#!/usr/bin/env bash
# Builds the container image (Containerfile) with buildah, without a container registry or the
# package index: `make image` (after `make dist`), or `tools/image/build.sh` with dist/ built.
#
# 1. The base image: BASE when set (any image buildah can use: python:3.11-slim where a registry
#    is reachable); otherwise localhost/rollout-grpc-base:bookworm-py3.11, a Debian 12 rootfs with
#    Python 3.11 made here by mmdebstrap from the host's apt sources (DEBIAN_SOURCES, a sources
#    file, to use others) and imported into buildah's storage. Built once: skipped while buildah
#    has it (`buildah rmi localhost/rollout-grpc-base:bookworm-py3.11` to rebuild it).
# 2. A wheelhouse: the wheel of dist/ and its [server] dependencies at the versions of the dev
#    virtualenv (binary wheels, from pip's cache when it has them) in .cache/image/context/dist.
# 3. buildah build (chroot isolation, no layer cache: no build-stage image is left behind) with pip
#    offline (--no-index) into IMAGE (default localhost/rollout-grpc:VERSION); prints its size.
# Needs buildah, and mmdebstrap for the local base (Debian: apt-get install buildah mmdebstrap);
# runs as root (buildah's storage in /var/lib/containers). Prints how long each step took.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' rollout_grpc/__init__.py)"
IMAGE="${IMAGE:-localhost/rollout-grpc:$VERSION}"
LOCAL_BASE=localhost/rollout-grpc-base:bookworm-py3.11
WORK="$ROOT/.cache/image"
CONTEXT="$WORK/context"
WHEEL="dist/rollout_grpc-$VERSION-py3-none-any.whl"

need() { command -v "$1" >/dev/null || { echo "image: $1 is missing (Debian: apt-get install $2)" >&2; exit 1; }; }
seconds_since() { echo "$(($(date +%s) - $1))"; }
need buildah buildah
[[ -f "$WHEEL" ]] || { echo "image: $WHEEL is missing: run make dist first" >&2; exit 1; }
[[ -x "$PY" ]] || { echo "image: no dev virtualenv: run make venv first" >&2; exit 1; }
mkdir -p "$WORK"

# The host's Debian sources (deb822 or one-line format) when they are bookworm's: Python 3.11.
debian_sources() {
  local file
  for file in "${DEBIAN_SOURCES:-}" /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    if [[ -n "$file" && -s "$file" ]] && grep -Eq '^[^#]*\bbookworm\b' "$file"; then
      echo "$file"
      return 0
    fi
  done
  echo "image: no bookworm apt sources on this host: set DEBIAN_SOURCES to a sources file, or BASE" >&2
  return 1
}

build_local_base() {
  local sources tar container start
  start=$(date +%s)
  need mmdebstrap mmdebstrap
  sources="$(debian_sources)"
  tar="$WORK/base-bookworm.tar"
  rm -f "$tar"
  # minbase: essential packages and apt (useradd comes with passwd); python3-venv brings python3.11
  # and the bundled pip. Documentation and translations are left out of the image.
  mmdebstrap --quiet --variant=minbase --include=python3-venv \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --format=tar bookworm "$tar" "$sources"
  container="$(buildah from scratch)"
  buildah add --quiet "$container" "$tar" / >/dev/null
  buildah config --env LANG=C.UTF-8 --cmd '["/bin/bash"]' "$container"
  buildah commit --quiet --rm "$container" "$LOCAL_BASE" >/dev/null
  rm -f "$tar"
  echo "image: base $LOCAL_BASE built in $(seconds_since "$start") s"
}

total=$(date +%s)
if [[ -z "${BASE:-}" ]]; then
  BASE="$LOCAL_BASE"
  if buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    echo "image: base $BASE present"
  else
    build_local_base
  fi
fi

start=$(date +%s)
rm -rf "$CONTEXT"
mkdir -p "$CONTEXT/dist"
cp "$WHEEL" "$CONTEXT/dist/"
"$PY" -m pip freeze --exclude-editable >"$WORK/constraints.txt"
# async-timeout: redis-py needs it below Python 3.11.3, and the base's Python is Debian 12's 3.11.2
# while this virtualenv's may be newer (pip evaluates the markers for the Python it runs on).
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
  --constraint "$WORK/constraints.txt" --dest "$CONTEXT/dist" "$CONTEXT/dist/$(basename "$WHEEL")[server]" \
  "async-timeout>=4.0.3" \
  2> >(grep -v "^WARNING: Location" >&2)
echo "image: wheelhouse ($(find "$CONTEXT/dist" -name '*.whl' | wc -l) wheels) in $(seconds_since "$start") s"

start=$(date +%s)
# The image IMAGE names now: the rebuild takes its name, and it would be left behind unnamed.
previous="$(buildah images --quiet --no-trunc "$IMAGE" 2>/dev/null || true)"
# Without --layers: a layer cache would keep the build stage as an image of its own (471 MB: the
# base, the wheelhouse and the venv) after every build, and the install step reruns whenever the
# wheel changes anyway. The base image above is the part worth keeping.
buildah build --quiet --isolation chroot \
  --build-arg "BASE=$BASE" --build-arg PIP_INSTALL_OPTS=--no-index \
  -f Containerfile -t "$IMAGE" "$CONTEXT" >/dev/null
echo "image: $IMAGE built in $(seconds_since "$start") s (total $(seconds_since "$total") s)"
current="$(buildah images --quiet --no-trunc "$IMAGE")"
if [[ -n "$previous" && "$previous" != "$current" ]]; then
  # Kept only while a container still uses it (`buildah rmi` refuses then).
  buildah rmi "$previous" >/dev/null 2>&1 || echo "image: the previous $IMAGE ($previous) is still in use; kept"
fi
echo "image: $IMAGE is $(buildah images --format '{{.Size}}' "$IMAGE")"
