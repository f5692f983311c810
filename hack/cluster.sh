#!/usr/bin/env bash
# Lifecycle of a local Kubernetes control plane for tests and the demo:
#   hack/cluster.sh up NAME     create (or reuse) the cluster, add fake GPU and CPU nodes,
#                               print the kubeconfig path on stdout
#   hack/cluster.sh down NAME   delete it and everything it wrote
#   hack/cluster.sh kubeconfig NAME
# etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as local processes
# (kwokctl --runtime binary) from binaries hack/provision.sh built; KWOK plays the kubelets.
# The Service range is a /16 (the API server's default /24 holds only 254 Services).
set -euo pipefail

CACHE="${PAGEKEEPER_CACHE:-$HOME/.cache/pagekeeper}"
BIN="$CACHE/bin"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KWOK_WORKDIR="${KWOK_WORKDIR:-$CACHE/kwok}"

cmd="${1:-}"; name="${2:-pagekeeper}"
kubeconfig="$KWOK_WORKDIR/clusters/$name/kubeconfig.yaml"

require_binaries() {
  local b
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok kwokctl; do
    [[ -x "$BIN/$b" ]] || { echo "missing $BIN/$b: run hack/provision.sh" >&2; exit 1; }
  done
}

up() {
  require_binaries
  if [[ ! -f "$kubeconfig" ]]; then
    # kwokctl picks each cluster's ports from those not yet bound, so two clusters created at
    # once (the test workers start theirs together) can pick the same ones: one creation at a
    # time, the lock held until the new cluster's processes have bound theirs (--wait). Those
    # processes outlive this script, so they must not inherit the lock's descriptor.
    mkdir -p "$KWOK_WORKDIR"
    exec 9>"$KWOK_WORKDIR/create.lock"
    flock -w 600 9 || { echo "waited 600 s for another cluster's creation" >&2; exit 1; }
    "$BIN/kwokctl" --name "$name" create cluster --runtime binary \
      --etcd-binary "$BIN/etcd" \
      --kube-apiserver-binary "$BIN/kube-apiserver" \
      --kube-controller-manager-binary "$BIN/kube-controller-manager" \
      --kube-scheduler-binary "$BIN/kube-scheduler" \
      --kwok-controller-binary "$BIN/kwok" \
      --kube-admission --kube-authorization \
      --extra-args "kube-apiserver=service-cluster-ip-range=10.96.0.0/16" \
      --kubeconfig "$KWOK_WORKDIR/clusters/$name/kubeconfig-user.yaml" \
      --wait 120s --timeout 180s >&2 9>&-
    exec 9>&-
  fi
  kubectl --kubeconfig "$kubeconfig" apply --server-side --field-manager pagekeeper-hack \
    -f "$HERE/nodes.yaml" >&2
  kubectl --kubeconfig "$kubeconfig" wait --for=condition=Ready node --all --timeout=60s >&2
  echo "$kubeconfig"
}

down() {
  [[ -x "$BIN/kwokctl" ]] || exit 0
  "$BIN/kwokctl" --name "$name" delete cluster \
    --kubeconfig "$KWOK_WORKDIR/clusters/$name/kubeconfig-user.yaml" >&2 || true
  rm -rf "$KWOK_WORKDIR/clusters/$name"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  kubeconfig) echo "$kubeconfig" ;;
  *) echo "usage: $0 up|down|kubeconfig [NAME]" >&2; exit 2 ;;
esac
