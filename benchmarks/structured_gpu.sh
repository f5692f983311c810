#!/usr/bin/env bash
# Structured output against plain text at 64 streams through HTTP, on one GPU (issue 62, item 1):
# the engine on random weights at the Qwen3-0.6B shape with a character tokenizer padded to its
# 151,936-token vocabulary, 200 sampled replies validated against the schema, then the schema's
# throughput pass and the plain pass over the same seeds and output lengths
# (benchmarks/structured.py). Writes $OUT/structured.json with the device and versions; exits
# non-zero if a sample misses the schema. With BEFORE=<a checkout of an earlier commit> the same
# passes run first from there, on the same card, into $OUT/structured_before.json; with
# BEFORE_PATH=<a folder of packages> as well, that pass imports them first (another xgrammar
# beside the same engine: BEFORE=$PWD).
#
#     OUT=/tmp/out bash benchmarks/structured_gpu.sh
#     BEFORE=/path/to/checkout-before OUT=/tmp/out bash benchmarks/structured_gpu.sh
#     BEFORE=$PWD BEFORE_PATH=/tmp/xgrammar-0.2.8 OUT=/tmp/out bash benchmarks/structured_gpu.sh
#     SMOKE=1 OUT=/tmp/out bash benchmarks/structured_gpu.sh     # the plumbing, on the CPU
#
# About 40 s on an H100 (36 s in run 51, docs/benchmarks.md; twice that with BEFORE).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the report goes to}"
mkdir -p "$OUT"
caller_path="${PYTHONPATH:-}"  # packages carried beside the checkouts, for both passes
export PYTHONPATH="$PWD/engine:$PWD/memplan:$PWD${caller_path:+:$caller_path}"
python -c "import xgrammar" || { echo "xgrammar is not installed" >&2; exit 2; }

if [[ "${SMOKE:-0}" == 1 ]]; then
  args=(--smoke --concurrency 8 --num-requests 16 --num-samples 8 --max-num-seqs 8)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv"
  args=(--concurrency 64 --num-requests 256 --num-samples 200)
fi
if [[ -n "${BEFORE:-}" ]]; then
  before_path="${BEFORE_PATH:+$BEFORE_PATH:}$BEFORE/engine:$BEFORE/memplan:$BEFORE"
  (cd "$BEFORE" && PYTHONPATH="$before_path${caller_path:+:$caller_path}" \
    python benchmarks/structured.py --shape qwen3-0.6b --concurrency 64 --num-requests 256 \
    --num-samples 200) > "$OUT/structured_before.json"
fi
python benchmarks/structured.py --shape qwen3-0.6b "${args[@]}" \
  --out "$OUT/structured.json" "$@"
python - "$OUT/structured.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(
    f"{report['num_matching']}/{report['num_samples']} samples match; schema "
    f"{report['schema_output_tok_s']:.0f} vs plain {report['plain_output_tok_s']:.0f} output "
    f"tok/s = {report['schema_over_plain']:.3f}x on {report['gpu'] or 'the CPU'}"
)
sys.exit(0 if report["num_matching"] == report["num_samples"] else 1)
PY
