#!/usr/bin/env bash
# What KV cache events cost, through HTTP on one GPU (issue 60): benchmarks/kv_events.py at the
# Qwen3-0.6B shape, random weights. Each server start serves W-nano's requests, then W-chat at
# 128 streams; the servers start events off, on, off, on, and each load's ratio is the median
# of its "on" passes over that of its "off" ones. Writes $OUT/kv_events.json (each pass's output
# tok/s, TTFT and ITL, the on/off ratios, the device) and each server's log under
# $OUT/kv_events_logs; exits non-zero if a pass failed a request or a server with events on did
# not start its publisher.
#
#     OUT=/tmp/out bash benchmarks/kv_events_gpu.sh
#     SMOKE=1 OUT=/tmp/out bash benchmarks/kv_events_gpu.sh      # the plumbing, on the CPU
#
# About 2.5 minutes on an H100 (155 s in run 50, docs/benchmarks.md): the four server starts
# are 60 s of it.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the report goes to}"
mkdir -p "$OUT/kv_events_logs"
export PYTHONPATH="$PWD/engine:$PWD/memplan:$PWD${PYTHONPATH:+:$PYTHONPATH}"
args=(--events-port "${KV_EVENTS_PORT:-5557}" --log-dir "$OUT/kv_events_logs"
      --json "$OUT/kv_events.json")

if [[ "${SMOKE:-0}" == 1 ]]; then
  checkpoint="$OUT/kv_events_checkpoint"
  python -c "import sys; from pathlib import Path; from harness.cpu_engine import write_tiny_checkpoint as w; w(Path(sys.argv[1]))" "$checkpoint"
  args+=(--smoke --device cpu --model-dir "$checkpoint")
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv"
  args+=(--shape qwen3-0.6b)
fi
status=0
python benchmarks/kv_events.py "${args[@]}" || status=$?
if [[ -f "$OUT/gpu.csv" && -f "$OUT/kv_events.json" ]]; then  # the device beside the figures
  python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
report = json.loads((out / "kv_events.json").read_text())
report["gpu"] = (out / "gpu.csv").read_text().splitlines()[1]
(out / "kv_events.json").write_text(json.dumps(report, indent=1))
print(f"on {report['gpu']}")
PY
fi
exit "$status"
