#!/usr/bin/env bash
# `make test` RUNS times (default 3) while another process keeps one core busy throughout: the
# suite must not depend on the machine's speed (docs/development.md). Every run goes ahead
# whatever the one before did, so one pass shows every flake; the exit status fails if any run
# failed, and the last lines say which.
set -uo pipefail
runs="${RUNS:-3}"
python3 -c 'while True: pass' &
hog=$!
trap 'kill "$hog" 2>/dev/null || true' EXIT
results=()
for run in $(seq 1 "$runs"); do
  echo "== make test, run $run of $runs, one core busy (pid $hog)"
  start=$(date +%s)
  if make test; then verdict=passed; else verdict=FAILED; fi
  results+=("run $run $verdict in $(( $(date +%s) - start )) s")
  echo "== ${results[-1]}"
done
printf '== %s\n' "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q FAILED
