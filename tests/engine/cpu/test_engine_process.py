"""The engine core's process body (`engine_process._serve`) over a fake runner: the handshake a
front end gets, and an out-of-memory give-up that writes the termination log and exits 1."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from pagekeeper_engine import engine_process
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.limits import resolve_limits
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.frontend.client import EngineDeadError
from pagekeeper_engine.frontend.core_client import CoreClient
from pagekeeper_engine.messages import CoreAddresses
from pagekeeper_engine.runner import runner as runner_module
from tests.engine.fakes import EOS, CharTokenizer, PagedFakeRunner

JOIN_TIMEOUT_S = 30.0


class OutOfMemoryRunner(PagedFakeRunner):
    """A fake runner with what the process reads off a real one; every step runs out of memory."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(64)
        self.oom_at_steps = set(range(1000))
        self.limits = resolve_limits(config, 128)
        self.block_size = config.block_size
        self.eos_token_ids = frozenset({EOS})
        self.kv_cache_dtype = "torch.float32"
        self.memory_budget_bytes = [{"weights": 100, "kv_cache": 200}]


def test_the_core_process_gives_up_writes_the_termination_log_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(runner_module, "ModelRunner", OutOfMemoryRunner)
    log = tmp_path / "termination-log"
    config = EngineConfig(
        model="fake",
        device="cpu",
        block_size=4,
        max_consecutive_ooms=1,
        termination_log_path=str(log),
    )
    codes: list[int] = []

    async def main(directory: str) -> Any:
        addresses = CoreAddresses(directory)
        client = CoreClient(addresses, 0, CharTokenizer().decode_batch)
        core = threading.Thread(
            target=lambda: codes.append(engine_process._serve(config, addresses, 1, lambda: True)),
            daemon=True,
        )
        core.start()
        try:
            ready = await client.wait_ready()
            with pytest.raises(EngineDeadError, match="gave up: 2 out-of-memory errors"):
                async for _ in client.generate("r", [1, 2, 3], SamplingParams(max_tokens=4)):
                    pass
            await asyncio.to_thread(core.join, JOIN_TIMEOUT_S)
            return ready
        finally:
            await client.close()

    with tempfile.TemporaryDirectory(prefix="pk-core-") as directory:
        ready = asyncio.run(main(directory))
    assert codes == [1]
    assert (ready.limits.max_model_len, ready.block_size, ready.num_gpu_blocks) == (128, 4, 64)
    assert ready.memory_budget_bytes == [{"weights": 100, "kv_cache": 200}]
    assert ready.kv_cache_dtype == "float32"
    assert log.read_text().startswith(
        "pagekeeper-oom kind=host phase=runtime detail=2 out-of-memory errors in a row"
    )
