"""`serving.py --api-key`: the benchmark's client processes send the key a locked server wants,
so W-chat runs against a server started with `--api-key` (on the CPU, a tiny checkpoint)."""

from __future__ import annotations

from pathlib import Path

import requests

from benchmarks import serving_client
from benchmarks import serving_workload as wl
from harness.cpu_engine import (
    VOCAB,
    EngineShape,
    spawn_engine,
    stop_engine,
    wait_engine_ready,
    write_tiny_checkpoint,
)

KEY = "sk-bench-77"


def test_the_clients_carry_the_key_a_locked_server_wants(tmp_path: Path) -> None:
    shape = EngineShape()
    engine = spawn_engine(
        write_tiny_checkpoint(tmp_path / "tiny"), tmp_path, shape, ["--api-key", KEY]
    )
    try:
        wait_engine_ready(engine)
        refused = requests.post(f"{engine.url}/v1/completions", json={}, timeout=30)
        assert refused.status_code == 401
        level = wl.Level(concurrency=2)
        work, warm = wl.level_workloads(
            level, 0, 4, vocab_size=len(VOCAB), prompt_lens=(4, 16), output_lens=(2, 6)
        )
        plans = wl.client_plans(
            level, (work, warm), 0, url=engine.url, model=shape.model_name, timeout_s=60.0,
            num_processes=1, api_key=KEY,
        )  # fmt: skip
        records = serving_client.run_plans(plans)
    finally:
        assert stop_engine(engine) == 0
    assert [r.failure for r in records] == [None] * 4
    assert sum(r.num_output_tokens for r in records) == sum(work.output_lens)
