"""`benchmarks/agent.py` (W-agent) on the CPU over a tiny random-weight shape: each pass serves
every turn, the sessions resend what the engine replied (so the tier serves their prefixes),
the fresh pass reuses nothing, and the host tier's bytes stay within its setting."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import agent
from benchmarks.shapes import SHAPES

TINY = {
    **SHAPES["qwen3-0.6b"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


def test_the_passes_serve_every_turn_and_the_tier_serves_the_sessions(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY))
    report = agent.main(
        [
            "--model-dir", str(model_dir), "--device", "cpu", "--kv-cache-memory", "1Mi",
            "--tier-gib", "0.01", "--sessions", "4", "--turns", "3", "--concurrency", "2",
            "--max-model-len", "2048", "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
            "--passes", "reuse-on", "fresh-on", "--json", str(tmp_path / "out.json"),
            "--log-dir", str(tmp_path),
        ]
    )  # fmt: skip
    reuse, fresh = report["passes"]["reuse-on"], report["passes"]["fresh-on"]
    for result in (reuse, fresh):
        assert result["requests"] == 12 and result["non_200"] == []
        assert result["server_exit_code"] == 0
        assert 0 < result["host_bytes_peak"] <= result["host_bytes_capacity"]
    assert reuse["prompt_tokens"] == fresh["prompt_tokens"]  # the same lengths
    host_hits = reuse["metrics_delta"]["pagekeeper_prefix_cache_hits_by_tier_total{tier=host}"]
    assert host_hits > 0 and reuse["cached_tokens_usage"] >= host_hits
    assert fresh["cached_tokens_usage"] == 0
    assert json.loads((tmp_path / "out.json").read_text())["passes"].keys() == {
        "reuse-on",
        "fresh-on",
    }
