#!/usr/bin/env bash
# The engine's slow paths on one GPU (issue 62), in calls of under ten minutes each:
#
#   structured  benchmarks/structured.py at 64 streams from this checkout and from each earlier
#               checkout in CHECKOUTS ("name=path ..."), alternated over ROUNDS rounds (default
#               2), so the spread between engine starts shows beside the change; ~50 s a pass.
#   wnano       benchmarks/throughput.py's W-nano at the Qwen3-0.6B shape, bf16 KV, then FP8
#               KV, each with the loop's host time by part and one more pass under cProfile
#               (--host-profile); ~80 s each.
#   tests       the GPU tests of the token pick, the seeded rows' draws and the structured
#               sampler.
#
# Every report goes into $OUT/slow_paths.tgz (a device returns few files), its summary to
# stdout; the GPU, driver and versions are in the reports. Exits non-zero if any part failed,
# after running the others.
#
#     OUT=/tmp/out bash benchmarks/slow_paths_gpu.sh structured wnano
#     CHECKOUTS="before=/tmp/25e79c6" OUT=/tmp/out bash benchmarks/slow_paths_gpu.sh structured
#     SMOKE=1 OUT=/tmp/out bash benchmarks/slow_paths_gpu.sh structured   # plumbing, on the CPU
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the reports go to}"
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(structured wnano tests)
work="$OUT/slow_paths"
mkdir -p "$work"
caller_path="${PYTHONPATH:-}"  # packages carried beside the checkouts, for every pass
export PYTHONPATH="$PWD/engine:$PWD/memplan:$PWD${caller_path:+:$caller_path}"
status=0

structured() {
  local args=(--concurrency 64 --num-requests 256 --num-samples 200)
  [[ "${SMOKE:-0}" == 1 ]] && args=(--smoke --concurrency 8 --num-requests 16 --num-samples 8
                                    --max-num-seqs 8)
  local checkouts=("head=$PWD")
  for entry in ${CHECKOUTS:-}; do checkouts+=("$entry"); done
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for entry in "${checkouts[@]}"; do
      local name="${entry%%=*}" path="${entry#*=}"
      local report="$work/structured_${name}_${round}.json"
      (cd "$path" && PYTHONPATH="$path/engine:$path/memplan:$path${caller_path:+:$caller_path}" \
        python benchmarks/structured.py --shape qwen3-0.6b "${args[@]}" > "$report") \
        || { echo "structured.py failed from $name, round $round" >&2; status=1; continue; }
      python - "$report" "$name" "$round" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
g = r.get("grammar", {})
def mean_ms(key):
    h = g.get(key) or {}
    return f"{h['sum_s'] / h['count'] * 1e3:.2f}" if h.get("count") else "-"
print(
    f"structured {sys.argv[2]} round {sys.argv[3]}: {r['num_matching']}/{r['num_samples']} "
    f"match, schema {r['schema_output_tok_s']:.0f} / plain {r['plain_output_tok_s']:.0f} tok/s "
    f"= {r['schema_over_plain']:.3f}x; mean ms: queue {mean_ms('queue')}, fill "
    f"{mean_ms('fill')}, wait {mean_ms('wait')}, apply {mean_ms('apply')}"
)
PY
    done
  done
}

wnano() {
  if [[ "${SMOKE:-0}" == 1 ]]; then
    echo "wnano needs a GPU: skipped under SMOKE" >&2
    return
  fi
  for kv in auto fp8; do
    python benchmarks/throughput.py --shape qwen3-0.6b --kv-cache-dtype "$kv" --host-profile \
      --json "$work/wnano_${kv}.json" 2>&1 | tee "$work/wnano_${kv}.txt" \
      || { echo "throughput.py failed at --kv-cache-dtype $kv" >&2; status=1; }
  done
}

tests() {
  python -m pytest -q -p no:cacheprovider tests/engine/kernels/test_sampling.py \
    tests/engine/kernels/test_seeded_noise.py tests/engine/kernels/test_shard_pick.py \
    tests/engine/gpu/test_logits_processing_gpu.py tests/engine/gpu/test_sampler_gpu.py \
    tests/engine/cpu/test_structured_output.py 2>&1 | tee "$work/tests.txt" | tail -5
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
}

if [[ "${SMOKE:-0}" != 1 ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/gpu.csv"
fi
python -c "import torch, triton, xgrammar, importlib.metadata as m; print('torch', torch.__version__, 'triton', triton.__version__, 'xgrammar', m.version('xgrammar'))" \
  | tee "$work/versions.txt"
for part in "${parts[@]}"; do
  case "$part" in
    structured|wnano|tests) "$part" ;;
    *) echo "unknown part $part (structured, wnano, tests)" >&2; status=2 ;;
  esac
done
tar -czf "$OUT/slow_paths.tgz" -C "$OUT" slow_paths && rm -rf "$work"
exit "$status"
