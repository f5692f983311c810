"""`benchmarks/weights.py` end to end on the CPU at a tiny shape: every section runs and the
report holds what the GPU run records (FP8 on the dequantizing reference, the offload a no-op,
the KV byte request on host memory)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import weights
from pagekeeper_engine.heap import thaw_heap

# A 2-layer Llama whose vocabulary covers W-nano's ids (0..10,000) and the greedy prompts'
# (1,000..30,000).
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def test_every_section_runs_at_a_tiny_shape(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "report.json"
    argv = [
        "--device", "cpu", "--dtype", "float32", "--model-dir", str(model_dir), "--out", str(out),
        "--num-requests", "3", "--max-output", "5", "--itl-tokens", "4", "--accuracy-prompts", "2",
        "--accuracy-steps", "3", "--accuracy-prompt-len", "8", "--offload-gb", "1",
        "--offload-requests", "2", "--offload-max-output", "3", "--offload-itl-tokens", "4",
        "--kv-cache-memory-bytes", "1Mi", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "2048", "--no-async-scheduling",
    ]  # fmt: skip
    try:
        report = weights.main(argv)
    finally:
        thaw_heap()  # the engines froze the start-up heap, as in a benchmark's own process
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    bf16, fp8 = report["weights"]["bf16"], report["weights"]["fp8"]
    # W-nano's first 3 requests, their outputs capped at 5 tokens, all generated.
    assert bf16["complete"] and fp8["complete"]
    assert bf16["num_output_tokens"] == fp8["num_output_tokens"] == 3 * 5
    assert report["weights"]["accuracy"]["num_positions"] == 2 * 3
    offload = report["offload"]
    assert offload["offload"]["layer_ids"] == []  # a no-op on the CPU
    assert offload["without_offload"]["started"]  # the CPU has no budget to refuse
    assert offload["resident"]["num_output_tokens"] == 2 * 3
    kv = report["kv_cache_memory_bytes"]
    # 2 layers x k and v x 16 tokens x 2 KV heads x 8 x 4 bytes = 4,096 bytes a block.
    assert kv["bytes_per_block"] == 4096
    assert (kv["requested"], kv["num_gpu_blocks"], kv["allocated"]) == (2**20, 256, 2**20)
    assert kv["within_one_block"]
    assert "greedy agreement" in out.with_suffix(".md").read_text()


def test_fp8_alone_for_a_shape_whose_bf16_does_not_fit(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "report.json"
    argv = [
        "--device", "cpu", "--dtype", "float32", "--model-dir", str(model_dir), "--out", str(out),
        "--fp8-only", "--num-requests", "2", "--max-output", "3", "--itl-tokens", "4",
        "--accuracy-prompts", "1", "--accuracy-steps", "2", "--accuracy-prompt-len", "8",
        "--kv-cache-memory-bytes", "1Mi", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "2048", "--no-async-scheduling",
    ]  # fmt: skip
    try:
        report = weights.main(argv)
    finally:
        thaw_heap()
    assert set(report["weights"]) == {"fp8"} and "offload" not in report
    assert report["weights"]["fp8"]["num_output_tokens"] == 2 * 3
    assert report["kv_cache_memory_bytes"]["num_gpu_blocks"] == 256  # 1 MiB / 4 KiB
    assert out.with_suffix(".md").read_text().splitlines()[2].startswith("fp8 weights: W-nano")
