#!/usr/bin/env bash
# The container images, built with buildah and run with podman (no daemon), their storage and
# layer cache under $PAGEKEEPER_CACHE/containers:
#   hack/images.sh build [published|debian]   build the Dockerfile's two targets; print one line
#                                             "TARGET IMAGE-ID" each on stdout
#   hack/images.sh push REGISTRY [published|debian]
#                                             push both tags to REGISTRY/pagekeeper-*:TAG
#   hack/images.sh tags [published|debian]    print "TARGET NAME:TAG" for both targets
#   hack/images.sh base                       make the Debian base, unless it is there
#   hack/images.sh podman|buildah ARGS...     run the tool on this storage and configuration
# Bases: `published` (default) are the Dockerfile's own (python slim, CUDA PyTorch) and need
# their registry; `debian` are made here from Debian's packages alone: bookworm by mmdebstrap,
# imported as localhost/pagekeeper-base, and for the engine that base plus PyPI's torch (of the
# version the published engine base ships). Tags: pagekeeper-{operator,engine}:VERSION, with
# -bookworm appended for the debian bases. VERSION is pyproject.toml's.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
CACHE="${PAGEKEEPER_CACHE:-$HOME/.cache/pagekeeper}"
STORE="$CACHE/containers"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
BASE_IMAGE="localhost/pagekeeper-base:$SUITE"
SOURCE="${SOURCE:-https://github.com/pagekeeper-dev/pagekeeper}"
# The CA bundle a build trusts for HTTPS (pip); bound read-only for RUN steps, never copied.
BUILD_CA="${BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}"
TARGETS=(operator engine)

export CONTAINERS_CONF="$HERE/containers.conf"
export BUILDAH_ISOLATION=chroot # no OCI runtime (and no cgroups) needed to build

STORAGE=(--root "$STORE/storage" --runroot "$STORE/run" --storage-driver overlay)
BUILD=(--layers --network host)
[[ -f $BUILD_CA ]] && BUILD+=("--volume=$BUILD_CA:/etc/ssl/certs/ca-certificates.crt:ro")

log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
podman_() { podman "${STORAGE[@]}" "$@"; }
buildah_() { buildah "${STORAGE[@]}" "$@"; }
has_image() { podman_ image exists "$1"; }

version() { sed -n 's/^version = "\(.*\)"$/\1/p' "$REPO/pyproject.toml" | head -n 1; }
# The PyTorch the published engine base ships: its tag in the Dockerfile (pytorch/pytorch:X-...).
torch_version() {
  sed -n 's#^ARG TORCH_IMAGE=pytorch/pytorch:\([0-9.]*\)-.*#\1#p' "$REPO/Dockerfile"
}
revision() {
  git -C "$REPO" describe --always --dirty --abbrev=40 --exclude='*' 2>/dev/null || echo unknown
}
tag_of() { # target bases
  local suffix=""; [[ $2 == debian ]] && suffix="-$SUITE"
  echo "pagekeeper-$1:$(version)$suffix"
}

require() {
  local t
  for t in "$@"; do
    command -v "$t" >/dev/null || { echo "$t is missing: run hack/provision.sh" >&2; exit 1; }
  done
}

# bookworm, minimal, with Python and a virtual environment on PATH (Debian's Python refuses
# `pip install` outside one), like the python images the published operator base comes from.
make_base() {
  require mmdebstrap podman
  has_image "$BASE_IMAGE" && { log "$BASE_IMAGE: cached"; return; }
  local mode=root; [[ $(id -u) -eq 0 ]] || mode=unshare
  local tar; tar="$(mktemp -d)/base.tar"
  log "$BASE_IMAGE: mmdebstrap ($MIRROR)"
  mmdebstrap --mode="$mode" --variant=minbase --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    "$SUITE" "$tar" \
    "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
    "deb $SECURITY_MIRROR $SUITE-security main" >&2
  podman_ import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
    "$tar" "$BASE_IMAGE" >/dev/null
  rm -rf "$(dirname "$tar")"
}

make_torch_base() { # prints the image name
  local torch; torch="$(torch_version)"
  [[ -n $torch ]] || { echo "no pytorch/pytorch:X default for TORCH_IMAGE in Dockerfile" >&2; exit 1; }
  local image="localhost/pagekeeper-torch:$torch-$SUITE"
  log "$image: building (torch $torch from PyPI)"
  buildah_ build "${BUILD[@]}" \
    --build-arg "BASE=$BASE_IMAGE" --build-arg "TORCH_VERSION=$torch" \
    --tag "$image" --file "$HERE/torch-base.Containerfile" "$HERE" >&2
  echo "$image"
}

build() { # bases
  local bases="${1:-published}" args=() torch_image
  require buildah podman
  case "$bases" in
    published) ;;
    debian)
      make_base
      torch_image="$(make_torch_base)"
      args+=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE" --build-arg "TORCH_IMAGE=$torch_image") ;;
    *) echo "unknown bases $bases (published or debian)" >&2; exit 2 ;;
  esac
  local version revision target iid
  version="$(version)"; revision="$(revision)"
  args+=(--build-arg "VERSION=$version" --build-arg "REVISION=$revision" --build-arg "SOURCE=$SOURCE")
  iid="$(mktemp)"
  for target in "${TARGETS[@]}"; do
    log "$(tag_of "$target" "$bases"): building target $target ($bases bases)"
    local start=$SECONDS
    buildah_ build "${BUILD[@]}" "${args[@]}" --target "$target" --iidfile "$iid" \
      --tag "$(tag_of "$target" "$bases")" --file "$REPO/Dockerfile" "$REPO" >&2
    relabel "$(cat "$iid")" "$(tag_of "$target" "$bases")" \
      "org.opencontainers.image.version=$version" \
      "org.opencontainers.image.revision=$revision" \
      "org.opencontainers.image.source=$SOURCE" >"$iid"
    log "$(tag_of "$target" "$bases"): built in $((SECONDS - start)) s"
    echo "$target $(cat "$iid")"
  done
  rm -f "$iid"
}

# buildah's layer cache reuses a LABEL step whose build arguments changed (a new commit with
# no change to the image's files), keeping a stale revision; and its --label applies to the
# Dockerfile's last stage, not to --target. So the labels are checked after the build and,
# where stale, set on a commit of the image. Its timestamp is the commit's, so the same tree
# always gives the same image id.
relabel() { # image-id tag label...
  local image="$1" tag="$2" label have stale=0 flags=() ctr
  shift 2
  for label in "$@"; do
    have="$(podman_ image inspect --format "{{index .Config.Labels \"${label%%=*}\"}}" "$image")"
    [[ $have == "${label#*=}" ]] || stale=1
    flags+=(--label "$label")
  done
  if ((stale)); then
    ctr="$(buildah_ from --pull-never --quiet "$image")"
    buildah_ config "${flags[@]}" "$ctr"
    buildah_ commit --rm --quiet --timestamp "$(git -C "$REPO" log -1 --format=%ct 2>/dev/null || echo 0)" \
      "$ctr" "$tag"
  else
    echo "$image"
  fi
}

push() { # registry bases
  local registry="${1:?usage: hack/images.sh push REGISTRY [published|debian]}" target tag
  require podman
  for target in "${TARGETS[@]}"; do
    tag="$(tag_of "$target" "${2:-published}")"
    log "pushing $tag to $registry/$tag"
    podman_ push "localhost/$tag" "docker://${registry%/}/$tag" >&2
  done
}

cmd="${1:-}"; shift || true
case "$cmd" in
  build) build "$@" ;;
  push) push "$@" ;;
  tags) for t in "${TARGETS[@]}"; do echo "$t $(tag_of "$t" "${1:-published}")"; done ;;
  base) make_base ;;
  podman) require podman; exec podman "${STORAGE[@]}" "$@" ;;
  buildah) require buildah; exec buildah "${STORAGE[@]}" "$@" ;;
  *) echo "usage: $0 build|push|tags|base|podman|buildah ..." >&2; exit 2 ;;
esac
