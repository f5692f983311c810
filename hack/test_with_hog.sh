#!/usr/bin/env bash
# `make test` RUNS times (default 3) while another process keeps one core busy throughout: the
# suite must not depend on the machine's speed (docs/development.md). Stops at the first failure.
set -euo pipefail
runs="${RUNS:-3}"
python3 -c 'while True: pass' &
hog=$!
trap 'kill "$hog" 2>/dev/null || true' EXIT
for run in $(seq 1 "$runs"); do
  echo "== make test, run $run of $runs, one core busy (pid $hog)"
  start=$(date +%s)
  make test
  echo "== run $run passed in $(( $(date +%s) - start )) s"
done
