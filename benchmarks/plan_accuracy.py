"""The memory plan against the engine's own start-up budget, term by term, on this GPU.

For each case (a model shape at W-nano's serving settings, with a KV dtype, weight quantization
or a KV byte budget), the engine starts for real (random weights at the shape) and profiles its
memory; the plan (`pagekeeper_memplan`, what the operator and `pagekeeper-plan` compute before a
rollout) predicts the same terms from the shape, the policy and the GPU's memory as its node
label states it (`nvidia.com/gpu.memory`, nvidia-smi's MiB). Both are printed side by side with
the KV bytes' difference in percent (the goal: within 3%).

    python3 benchmarks/plan_accuracy.py --json $OUT/plan.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline_engine import stop_ranks, write_checkpoint
from benchmarks.shapes import SHAPES
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.runner.runner import ModelRunner
from pagekeeper_memplan.gpus import GpuModel, parse_product
from pagekeeper_memplan.plan import PlanInputs, plan_memory
from pagekeeper_memplan.shape import parse_shape

GiB = 1 << 30
MiB = 1 << 20
# The engine's budget terms that each plan term predicts (the engine counts the CUDA graphs'
# pool among its peak activations).
PAIRS = (
    ("weights", ("weights",), ("weights",)),
    ("activations + graphs", ("activations", "cudaGraphs"), ("peak_activations",)),
    ("non-torch", ("nonTorch",), ("non_torch",)),
    ("fragmentation buffer", ("fragmentationBuffer",), ("fragmentation_buffer",)),
    ("KV cache", ("kvCache",), ("kv_cache",)),
)


@dataclass(frozen=True)
class Case:
    shape: str
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    kv_cache_memory: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        parts = [self.shape, f"kv {self.kv_cache_dtype}"]
        if self.quantization != "none":
            parts.append(f"weights {self.quantization}")
        if self.kv_cache_memory is not None:
            parts.append(f"kvCacheMemory {self.kv_cache_memory / GiB:g} GiB")
        return ", ".join(parts)


CASES = (
    Case("qwen3-0.6b"),
    Case("qwen3-0.6b", kv_cache_dtype="fp8"),
    Case("llama-3.1-8b"),
    Case("llama-3.1-8b", kv_cache_dtype="fp8"),
    Case("llama-3.1-8b", quantization="fp8"),
    Case("llama-3.1-8b", kv_cache_memory=20 * GiB),
)
# W-nano's serving settings (offline_engine.build_engine), which the plan is given as a policy.
SETTINGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 4096,
    "max_num_seqs": 256,
    "block_size": 16,
    "max_num_batched_tokens": 8192,
    "gpu_memory_utilization": 0.9,
    "fragmentation_buffer": "auto",
}


def engine_terms(case: Case, model_dir: Path) -> dict[str, int]:
    settings = {
        **SETTINGS,
        "model": str(model_dir),
        "load_format": "dummy",
        "device": "cuda",
        "swap_space": 0.0,
        "kv_cache_dtype": case.kv_cache_dtype,
        **case.settings,
    }
    if case.quantization != "none":
        settings["quantization"] = case.quantization
    if case.kv_cache_memory is not None:
        settings["kv_cache_memory_bytes"] = case.kv_cache_memory
        settings.pop("gpu_memory_utilization")
    runner = ModelRunner(EngineConfig(**settings), progress=False)
    terms = runner.memory_budget_bytes
    assert terms is not None, "the engine profiled no budget"
    result = dict(terms[0])
    result["num_blocks"] = runner.num_gpu_blocks
    del runner
    stop_ranks()
    return result


def plan_terms(case: Case, gpu: GpuModel) -> dict[str, int]:
    inputs = PlanInputs(
        dtype=SETTINGS["dtype"],
        quantization="fp8" if case.quantization == "fp8" else "none",
        kv_cache_dtype="fp8" if case.kv_cache_dtype == "fp8" else "auto",
        block_size=SETTINGS["block_size"],
        max_num_batched_tokens=SETTINGS["max_num_batched_tokens"],
        max_num_seqs=SETTINGS["max_num_seqs"],
        max_model_len=SETTINGS["max_model_len"],
        gpu_memory_utilization=None if case.kv_cache_memory else SETTINGS["gpu_memory_utilization"],
        kv_cache_memory=case.kv_cache_memory,
    )
    plan = plan_memory(parse_shape(SHAPES[case.shape], case.shape), inputs, gpu)
    return {**plan.terms, "num_blocks": plan.num_blocks}


def compare(case: Case, gpu: GpuModel, root: Path) -> dict[str, Any]:
    model_dir = write_checkpoint(case.shape, root)
    measured = engine_terms(case, model_dir)
    planned = plan_terms(case, gpu)
    rows = []
    for label, plan_keys, engine_keys in PAIRS:
        predicted = sum(planned[k] for k in plan_keys)
        actual = sum(measured[k] for k in engine_keys)
        rows.append(
            {
                "term": label,
                "planned_mib": predicted / MiB,
                "engine_mib": actual / MiB,
                "difference_pct": 100.0 * (predicted - actual) / actual if actual else 0.0,
            }
        )
    print(f"\n{case.name} (engine total {measured['total'] / GiB:.2f} GiB, plan's GPU "
          f"{gpu.name} {gpu.memory_bytes / GiB:.2f} GiB)")  # fmt: skip
    print(f"  {'term':<22}{'plan MiB':>12}{'engine MiB':>12}{'diff %':>9}")
    for row in rows:
        print(
            f"  {row['term']:<22}{row['planned_mib']:>12.1f}{row['engine_mib']:>12.1f}"
            f"{row['difference_pct']:>9.2f}"
        )
    print(f"  KV blocks: plan {planned['num_blocks']}, engine {measured['num_blocks']}")
    return {"case": case.name, "rows": rows, "engine": measured, "plan": planned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default=None, help="the plan's GPU (default: this device's name)")
    parser.add_argument("--only", nargs="*", default=None, help="case names' shapes to run")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    name = args.gpu or torch.cuda.get_device_name()
    gpu = parse_product(name)
    assert gpu is not None, f"no GPU product matches {name!r}"
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}; the plan assumes {gpu}")
    results = []
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as root:
        for case in CASES:
            if args.only and case.shape not in args.only:
                continue
            try:
                results.append(compare(case, gpu, Path(root)))
            except (TypeError, ValueError, RuntimeError) as error:  # a case the engine lacks
                print(f"\n{case.name}: not run ({type(error).__name__}: {error})")
                results.append({"case": case.name, "error": str(error)})
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
