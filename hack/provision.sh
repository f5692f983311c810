#!/usr/bin/env bash
# Provision the local test environment into $PAGEKEEPER_CACHE (default ~/.cache/pagekeeper):
# Kubernetes control-plane binaries, etcd, kwok/kwokctl, helm and prometheus-adapter built from
# their Go modules, the Prometheus Operator CRDs, the Gateway API Inference Extension's
# InferencePool CRD and KEDA's ScaledObject CRD from their Go modules, prometheus/promtool/
# alertmanager from Debian's packages, the image tools (buildah, podman, mmdebstrap, runc) from
# Debian's packages too, and one environment per tested vLLM version (vllm from PyPI, no GPU
# needed) for the plugin and flag-contract tests, and the GitOps health checks: kstatus
# (hack/kstatus over sigs.k8s.io/cli-utils) and Argo CD's Lua health test binary. Every step is
# skipped when its output is already there.
set -euo pipefail

CACHE="${PAGEKEEPER_CACHE:-$HOME/.cache/pagekeeper}"
BIN="$CACHE/bin"
K8S_VERSION="${K8S_VERSION:-v1.33.13}"
ETCD_VERSION="${ETCD_VERSION:-v3.5.35}"
KWOK_VERSION="${KWOK_VERSION:-v0.7.0}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
PROM_OPERATOR_VERSION="${PROM_OPERATOR_VERSION:-v0.85.0}"
# v1.0.0 introduced inference.networking.k8s.io/v1; later versions add fields we do not set.
INFERENCE_EXTENSION_VERSION="${INFERENCE_EXTENSION_VERSION:-v1.4.0}"
# The oldest vLLM the operator's default image runs, and the newest tested (hack/vllm/*.txt).
VLLM_VERSIONS="${VLLM_VERSIONS:-0.11.0 0.33.0}"
PROMETHEUS_ADAPTER_VERSION="${PROMETHEUS_ADAPTER_VERSION:-v0.12.0}"
KEDA_VERSION="${KEDA_VERSION:-v2.21.0}"
# The GitOps health checks: Argo CD's Lua health tests and kstatus (what Flux reads).
ARGOCD_VERSION="${ARGOCD_VERSION:-v3.2.0}"
CLI_UTILS_VERSION="${CLI_UTILS_VERSION:-v0.37.2}"
HERE="$(cd "$(dirname "$0")" && pwd)"

export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 GOFLAGS=-mod=mod
export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" GOPATH="$CACHE/go/path"
mkdir -p "$BIN" "$GOMODCACHE" "$GOCACHE" "$GOPATH"

log() { printf '[provision %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
have() { [[ -x "$BIN/$1" ]]; }

# A scratch module that requires k8s.io/kubernetes and replaces every staging module
# (listed in the .mod file the proxy serves) with its published v0.X twin.
build_kubernetes() {
  local want=(kube-apiserver kube-controller-manager kube-scheduler)
  local missing=0 b
  for b in "${want[@]}"; do have "$b" || missing=1; done
  ((missing)) || { log "kubernetes $K8S_VERSION: cached"; return; }
  local staging="v0.${K8S_VERSION#v1.}"
  local work="$CACHE/src/kubernetes-$K8S_VERSION"
  mkdir -p "$work"
  local gomod
  gomod=$(cd "$work" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
    | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
  {
    echo "module pagekeeper.dev/hack/kubernetes"
    echo "go 1.24"
    echo "require k8s.io/kubernetes $K8S_VERSION"
    sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9.-]*\) => ./staging/.*#replace \1 => \1 '"$staging"'#p' "$gomod"
  } >"$work/go.mod"
  rm -f "$work/tools.go" # an import of main packages, from an earlier version of this script
  # Module zips carry no git metadata; the commit is not knowable, the version is.
  local commit="0000000000000000000000000000000000000000"
  local pkg="k8s.io/component-base/version"
  local ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 \
-X $pkg.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2) -X $pkg.gitTreeState=clean \
-X $pkg.gitCommit=$commit -X $pkg.buildDate=1970-01-01T00:00:00Z"
  # No tidy: the commands are main packages, which no Go file may import, so the module has no
  # code of its own. `go build` (GOFLAGS=-mod=mod) adds the requirements and sums it needs.
  log "kubernetes $K8S_VERSION: resolving modules"
  (cd "$work" && go mod download)
  for b in "${want[@]}"; do
    have "$b" && continue
    log "kubernetes $K8S_VERSION: building $b"
    (cd "$work" && go build -trimpath -ldflags "$ldflags" -o "$BIN/$b" "k8s.io/kubernetes/cmd/$b")
  done
}

build_etcd() {
  have etcd && { log "etcd $ETCD_VERSION: cached"; return; }
  local work="$CACHE/src/etcd-$ETCD_VERSION"
  mkdir -p "$work"
  printf 'module pagekeeper.dev/hack/etcd\ngo 1.24\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" >"$work/go.mod"
  printf 'package tools\n\nimport _ "go.etcd.io/etcd/server/v3/etcdmain"\n' >"$work/tools.go"
  log "etcd $ETCD_VERSION: building"
  (cd "$work" && go mod tidy >/dev/null && \
    printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' >main.go && \
    rm -f tools.go && go mod tidy >/dev/null && go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" .)
}

go_install() { # name module-path version
  have "$1" && { log "$1 $3: cached"; return; }
  log "$1 $3: building"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w $4" "$2@$3"
}

prometheus_operator_crds() {
  local dest="$CACHE/crds/prometheus-operator-$PROM_OPERATOR_VERSION"
  [[ -f "$dest/.done" ]] && { log "prometheus-operator CRDs: cached"; return; }
  log "prometheus-operator CRDs $PROM_OPERATOR_VERSION: fetching module"
  local dir
  dir=$(cd "$CACHE" && go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROM_OPERATOR_VERSION" \
    | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  mkdir -p "$dest"
  cp "$dir"/example/prometheus-operator-crd/monitoring.coreos.com_{servicemonitors,podmonitors,prometheusrules}.yaml "$dest/"
  chmod u+w "$dest"/*.yaml
  touch "$dest/.done"
}

inference_pool_crd() {
  local dest="$CACHE/crds/gateway-api-inference-extension-$INFERENCE_EXTENSION_VERSION"
  [[ -f "$dest/.done" ]] && { log "InferencePool CRD: cached"; return; }
  log "InferencePool CRD $INFERENCE_EXTENSION_VERSION: fetching module"
  local dir
  dir=$(cd "$CACHE" && go mod download -json "sigs.k8s.io/gateway-api-inference-extension@$INFERENCE_EXTENSION_VERSION" \
    | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  mkdir -p "$dest"
  # Only the v1 API (inference.networking.k8s.io); the x-k8s.io ones are alpha.
  cp "$dir"/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml "$dest/"
  chmod u+w "$dest"/*.yaml
  touch "$dest/.done"
}

# Go's module directory of `module@version`, downloading it first if needed.
module_dir() {
  (cd "$CACHE" && go mod download -json "$1") | sed -n 's/.*"Dir": "\(.*\)",/\1/p'
}

# The adapter is built inside a writable copy of its own module, so the dependency versions
# its go.mod pins are the ones built (a scratch module requiring it would resolve others).
build_prometheus_adapter() {
  have prometheus-adapter && { log "prometheus-adapter $PROMETHEUS_ADAPTER_VERSION: cached"; return; }
  local work="$CACHE/src/prometheus-adapter-$PROMETHEUS_ADAPTER_VERSION" dir
  dir=$(module_dir "sigs.k8s.io/prometheus-adapter@$PROMETHEUS_ADAPTER_VERSION")
  [[ -n "$dir" ]] || { echo "prometheus-adapter $PROMETHEUS_ADAPTER_VERSION: module not found" >&2; exit 1; }
  rm -rf "$work"
  cp -r "$dir" "$work"
  chmod -R u+w "$work"
  log "prometheus-adapter $PROMETHEUS_ADAPTER_VERSION: building"
  (cd "$work" && go build -trimpath -ldflags "-s -w" -o "$BIN/prometheus-adapter" ./cmd/adapter)
}

keda_crds() {
  local dest="$CACHE/crds/keda-$KEDA_VERSION"
  [[ -f "$dest/.done" ]] && { log "KEDA CRDs: cached"; return; }
  log "KEDA CRDs $KEDA_VERSION: fetching module"
  local dir
  dir=$(module_dir "github.com/kedacore/keda/v2@$KEDA_VERSION")
  mkdir -p "$dest"
  # The operator renders ScaledObjects only; their schema is what the tests check against.
  cp "$dir"/config/crd/bases/keda.sh_scaledobjects.yaml "$dest/"
  chmod u+w "$dest"/*.yaml
  touch "$dest/.done"
}

# Argo CD reads a resource's health script from the scripts it embeds at build time, so its Lua
# test binary (`go test -c ./util/lua/`, whose TestLuaHealthScript walks
# ../../resource_customizations) is built in a writable copy of its module with our script added
# under pagekeeper.dev/LLMServer. The copy keeps Argo CD's go.mod, so its pinned dependencies are
# the ones built. A changed script rebuilds only the embedding package and the link.
ARGOCD_LUA_TEST="$BIN/argocd-lua-health.test"
build_argocd_lua_test() {
  local script="$HERE/../charts/pagekeeper/argocd/health.lua"
  local work="$CACHE/src/argo-cd-$ARGOCD_VERSION"
  local ours="$work/resource_customizations/pagekeeper.dev/LLMServer"
  if have argocd-lua-health.test && cmp -s "$script" "$ours/health.lua"; then
    log "argo-cd $ARGOCD_VERSION lua test: cached"; return
  fi
  if [[ ! -f "$work/.copied" ]]; then
    local dir
    dir=$(module_dir "github.com/argoproj/argo-cd/v3@$ARGOCD_VERSION")
    [[ -n "$dir" ]] || { echo "argo-cd $ARGOCD_VERSION: module not found" >&2; exit 1; }
    rm -rf "$work"
    cp -r "$dir" "$work"
    chmod -R u+w "$work"
    touch "$work/.copied"
  fi
  mkdir -p "$ours"
  cp "$script" "$ours/health.lua"
  log "argo-cd $ARGOCD_VERSION lua test: building (cold: ~800 MB of modules)"
  (cd "$work" && go test -c -trimpath -ldflags "-s -w" -o "$ARGOCD_LUA_TEST.tmp" ./util/lua/)
  mv "$ARGOCD_LUA_TEST.tmp" "$ARGOCD_LUA_TEST"
}

# hack/kstatus: a small program over sigs.k8s.io/cli-utils' kstatus, the status rules Flux applies.
build_kstatus() {
  local src="$HERE/kstatus"
  local stamp="$CACHE/src/kstatus.sha256"
  local sum
  sum=$(cat "$src/go.mod" "$src/main.go" | sha256sum | cut -d' ' -f1)
  if have kstatus && [[ -f "$stamp" && "$(cat "$stamp")" == "$sum" ]]; then
    log "kstatus (cli-utils $CLI_UTILS_VERSION): cached"; return
  fi
  log "kstatus (cli-utils $CLI_UTILS_VERSION): building"
  (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$BIN/kstatus" .)
  echo "$sum" >"$stamp"
}

debian_tools() {
  local need=()
  command -v prometheus >/dev/null || need+=(prometheus)
  command -v promtool >/dev/null || need+=(prometheus)
  command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
  ((${#need[@]})) || { log "prometheus, promtool, alertmanager: installed"; return; }
  log "apt-get install ${need[*]}"
  local sudo=""; [[ $(id -u) -eq 0 ]] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # Debian starts the services on install; tests run their own instances.
  $sudo systemctl disable --now prometheus prometheus-alertmanager prometheus-node-exporter 2>/dev/null || true
  pkill -x prometheus 2>/dev/null || true; pkill -x alertmanager 2>/dev/null || true
  pkill -x prometheus-alertmanager 2>/dev/null || true
}

# The daemonless image builder and runner hack/images.sh uses; uidmap lets them run rootless.
container_tools() {
  local need=() tool
  for tool in buildah podman mmdebstrap runc; do command -v "$tool" >/dev/null || need+=("$tool"); done
  [[ $(id -u) -eq 0 ]] || command -v newuidmap >/dev/null || need+=(uidmap)
  ((${#need[@]})) || { log "buildah, podman, mmdebstrap, runc: installed"; return; }
  log "apt-get install ${need[*]}"
  local sudo=""; [[ $(id -u) -eq 0 ]] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

# $CACHE/vllm/<version>: a virtual environment with vllm (--no-deps) and the pure-Python
# packages its parser and plugin loader import; the project's environment (torch, transformers,
# ...) is on its path through a .pth file, and its own packages come first.
vllm_envs() {
  local main_py="$CACHE/venv/bin/python" version dir site
  [[ -x "$main_py" ]] || { echo "vllm environments need $CACHE/venv (make venv)" >&2; exit 1; }
  for version in $VLLM_VERSIONS; do
    dir="$CACHE/vllm/$version"
    [[ -f "$dir/.done" ]] && { log "vllm $version: cached"; continue; }
    log "vllm $version: installing into $dir"
    rm -rf "$dir"
    "$main_py" -m venv --without-pip "$dir"
    site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$main_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/pagekeeper-main.pth"
    "$main_py" -m pip install -q --disable-pip-version-check --target "$site" --no-deps \
      "vllm==$version" -r "$(dirname "$0")/vllm/$version.txt"
    touch "$dir/.done"
  done
}

# What the control plane, Prometheus' CRDs and the GitOps checks need, in two lanes side by side:
# the Kubernetes build in one, the smaller builds and the module downloads in the other. On two
# cores the compilers share the CPU; the lanes overlap one's downloads with the other's builds.
core() {
  build_kubernetes &
  local kubernetes=$! failed=0
  (
    set -e
    prometheus_operator_crds; inference_pool_crd; keda_crds; build_etcd
    go_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
    go_install kwokctl sigs.k8s.io/kwok/cmd/kwokctl "$KWOK_VERSION" "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
    go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
    build_prometheus_adapter; build_kstatus
  ) || failed=1
  wait "$kubernetes" || failed=1
  ((failed == 0)) || { echo "provisioning the core tools failed (above)" >&2; exit 1; }
}

main() {
  local what=("${@:-all}")
  local start=$SECONDS
  for w in "${what[@]}"; do
    case "$w" in
      all) debian_tools; container_tools; core; vllm_envs; build_argocd_lua_test ;;
      core) core ;;
      packages) debian_tools; container_tools ;;
      gitops) build_kstatus; build_argocd_lua_test ;;
      argocd) build_argocd_lua_test ;;
      kstatus) build_kstatus ;;
      vllm) vllm_envs ;;
      debian) debian_tools ;;
      containers) container_tools ;;
      crds) prometheus_operator_crds; inference_pool_crd; keda_crds ;;
      adapter) build_prometheus_adapter ;;
      etcd) build_etcd ;;
      kubernetes) build_kubernetes ;;
      *) echo "unknown target $w" >&2; exit 2 ;;
    esac
  done
  log "done in $((SECONDS - start))s; binaries in $BIN"
}
main "$@"
