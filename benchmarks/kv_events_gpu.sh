#!/usr/bin/env bash
# What KV cache events cost, through HTTP on one GPU (issue 60): the same server with
# `--kv-events-config` (zmq publisher, vLLM's array encoding) against without, prefix caching on
# in both (the events describe the prefix cache), on two loads:
# - W-nano's requests (256 prompts of 100-1,024 tokens, replies of 100-1,024, all at once);
# - W-chat at 128 streams (benchmarks/serving.py's defaults).
# Each load runs off, on, off, on, so a drift of the card shows as a spread between the repeats;
# the report is the median of each pair. Writes $OUT/kv_events.json (each pass's output tok/s,
# the on/off ratios, the device) and each server's log; exits non-zero if a pass failed a request
# or a server with events on did not start its publisher.
#
#     OUT=/tmp/out bash benchmarks/kv_events_gpu.sh
#     SMOKE=1 OUT=/tmp/out bash benchmarks/kv_events_gpu.sh      # the plumbing, on the CPU
#
# About 6-8 minutes on an H100: each of the 8 passes starts its own server.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the report goes to}"
mkdir -p "$OUT/kv_events_logs"
export PYTHONPATH="$PWD/engine:$PWD/memplan:$PWD${PYTHONPATH:+:$PYTHONPATH}"
port="${KV_EVENTS_PORT:-5557}"  # the publisher's port (one server at a time binds it)
EVENTS='--kv-events-config={"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:'"$port"'"}'

if [[ "${SMOKE:-0}" == 1 ]]; then
  checkpoint="$OUT/kv_events_checkpoint"
  python -c "import sys; from pathlib import Path; from harness.cpu_engine import write_tiny_checkpoint as w; w(Path(sys.argv[1]))" "$checkpoint"
  common=(--device cpu --model-dir "$checkpoint" --no-offline)
  nano=(--concurrency 8 --num-requests 16 --prompt-min 16 --prompt-max 64 --output-min 8 --output-max 16)
  chat=(--concurrency 4 --num-requests 16 --prompt-max 64 --output-max 16)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv"
  common=(--shape qwen3-0.6b --no-offline)
  nano=(--concurrency 256 --num-requests 256 --prompt-min 100 --prompt-max 1024
        --output-min 100 --output-max 1024 --max-model-len 2048)
  chat=(--concurrency 128)
fi

run() {  # run NAME EVENTS(on|off) ARGS...
  local name=$1 events=$2
  shift 2
  local extra=()
  [[ "$events" == on ]] && extra=("--engine-arg=$EVENTS")
  python benchmarks/serving.py "${common[@]}" "$@" "${extra[@]}" \
    --server-log "$OUT/kv_events_logs/$name.log" --json "$OUT/kv_events_logs/$name.json" \
    > "$OUT/kv_events_logs/$name.out"
}

for repeat in 1 2; do
  for events in off on; do
    run "nano-$events-$repeat" "$events" "${nano[@]}"
    run "chat-$events-$repeat" "$events" "${chat[@]}"
  done
done

python - "$OUT" <<'PY'
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
logs = out / "kv_events_logs"
gpu = (out / "gpu.csv").read_text().splitlines()[1:] if (out / "gpu.csv").exists() else []
report = {"gpu": gpu[0] if gpu else None, "passes": {}, "ratios": {}}
failed = []
for load in ("nano", "chat"):
    medians = {}
    for events in ("off", "on"):
        figures = []
        for repeat in (1, 2):
            name = f"{load}-{events}-{repeat}"
            run = json.loads((logs / f"{name}.json").read_text())
            online = run["levels"][0]["online"]
            figures.append(online["output_tok_s"])
            report["passes"][name] = {
                "output_tok_s": online["output_tok_s"],
                "num_ok": online["num_ok"],
                "num_requests": online["num_requests"],
                "ttft_ms": online["ttft_ms"],
                "itl_ms": online["itl_ms"],
            }
            if online["num_ok"] != online["num_requests"]:
                failed.append(f"{name}: {online['num_ok']}/{online['num_requests']} ok")
            if events == "on" and "publishing KV events" not in (logs / f"{name}.log").read_text():
                failed.append(f"{name}: the server never started its KV event publisher")
        medians[events] = statistics.median(figures)
    report["ratios"][load] = medians["on"] / medians["off"]
(out / "kv_events.json").write_text(json.dumps(report, indent=1))
for load, ratio in report["ratios"].items():
    print(f"{load}: events on / off output tok/s = {ratio:.3f} on {report['gpu'] or 'the CPU'}")
for line in failed:
    print(line, file=sys.stderr)
sys.exit(1 if failed else 0)
PY
