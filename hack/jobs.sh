#!/usr/bin/env bash
# Background jobs of `make test`: the slow one-off builds (the test images, Argo CD's Lua test
# binary) start first and overlap the rest of the run; the tests that need one wait for it
# (tests/support/jobs.py), and `make test` waits for all of them at its end.
#   hack/jobs.sh start NAME COMMAND...   run COMMAND in the background: $PAGEKEEPER_JOBS/NAME.log
#                                        gets its output, NAME.rc its exit status once it ends
#   hack/jobs.sh wait NAME...            until each has ended; fails (with the log's tail) if
#                                        one failed or ended without a status
# A job that was never started is nothing to wait for.
set -euo pipefail

DIR="${PAGEKEEPER_JOBS:?PAGEKEEPER_JOBS: the folder of the background jobs}"
mkdir -p "$DIR"

log() { printf '[jobs %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

start() { # name command...
  local name="$1"; shift
  rm -f "$DIR/$name.rc" "$DIR/$name.pid"
  # setsid: out of make's process group, so the job outlives the recipe line that started it;
  # nice: the builds on the critical path (the venv, the control plane's tools) and the tests
  # come first, and the job takes the CPU they leave.
  setsid -w nice -n 10 bash -c '
    start=$SECONDS
    "${@:3}" >"$1/$2.log" 2>&1 && rc=0 || rc=$?
    echo "$rc $((SECONDS - start))" >"$1/$2.rc.tmp" && mv "$1/$2.rc.tmp" "$1/$2.rc"
  ' job "$DIR" "$name" "$@" </dev/null >/dev/null 2>&1 &
  echo $! >"$DIR/$name.pid"
  log "$name: started (pid $!): $*"
}

wait_one() { # name
  local name="$1" pid rc seconds
  [[ -f "$DIR/$name.pid" ]] || { log "$name: not started"; return 0; }
  pid="$(cat "$DIR/$name.pid")"
  while [[ ! -f "$DIR/$name.rc" ]]; do
    if ! kill -0 "$pid" 2>/dev/null; then
      sleep 1 # it may have written its status just now
      [[ -f "$DIR/$name.rc" ]] && break
      log "$name: ended without a status"; tail -n 40 "$DIR/$name.log" >&2 || true; return 1
    fi
    sleep 2
  done
  read -r rc seconds <"$DIR/$name.rc"
  if [[ "$rc" != 0 ]]; then
    log "$name: failed ($rc) after $seconds s; the end of $DIR/$name.log:"
    tail -n 40 "$DIR/$name.log" >&2
    return 1
  fi
  log "$name: done in $seconds s"
}

cmd="${1:-}"; shift || true
case "$cmd" in
  start) start "$@" ;;
  wait) failed=0; for n in "$@"; do wait_one "$n" || failed=1; done; exit "$failed" ;;
  *) echo "usage: $0 start NAME COMMAND... | wait NAME..." >&2; exit 2 ;;
esac
