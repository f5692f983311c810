"""The real model runner on the CPU under memory pressure: swap round trips through the engine,
the allocation-free swap fallback, and an injected out-of-memory error inside the forward pass.
Each run must produce the greedy tokens of an unconstrained run."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.limits import SchedulerConfig
from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.memory import swap
from pagekeeper_engine.memory.oom import DeviceOutOfMemoryError
from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.checkpoints import make_runner, seq, tokens, write_checkpoint
from tests.engine.fakes import IdTokenizer

PROMPTS = {f"r{i}": tokens(9 + 2 * i, offset=5 * i + 1) for i in range(4)}
# ignore_eos: the random model may pick its EOS id, and every run must go the full length
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, "llama")
    return path


def run_engine(runner: ModelRunner, **sched: Any) -> tuple[LLMEngine, dict[str, list[int]]]:
    config = EngineConfig(
        model="tiny", block_size=8, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4
    )
    sched_config = replace(SchedulerConfig.from_engine_config(config, runner.limits), **sched)
    engine = LLMEngine(config, runner, IdTokenizer().eos_token_ids, sched_config)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, PARAMS)
    generated: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for _ in range(500):
        if not engine.has_work():
            return engine, generated
        for out in engine.step():
            assert out.error is None, out.error
            generated[out.request_id] += out.new_token_ids
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[str, list[int]]:
    engine, generated = run_engine(make_runner(checkpoint, num_blocks=40))
    assert engine.stats().num_preemptions == 0
    assert all(len(ids) == 12 for ids in generated.values())
    return generated


def test_swap_round_trips_through_the_engine_keep_the_tokens(
    checkpoint: Path, reference: dict[str, list[int]]
) -> None:
    runner = make_runner(checkpoint, num_blocks=10, num_cpu_blocks_override=16)
    engine, generated = run_engine(runner, min_swap_tokens=4)
    stats = engine.stats()
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions == 0
    assert generated == reference
    assert (stats.num_swap_blocks_used, stats.num_used_blocks) == (0, 0)
    assert dict(stats.num_oom_events) == {"step": 0, "swap": 0, "startup": 0}


def test_swap_without_device_memory_falls_back_and_is_counted(
    checkpoint: Path, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(swap, "_copy_gathered", no_memory)
    runner = make_runner(checkpoint, num_blocks=10, num_cpu_blocks_override=16)
    engine, generated = run_engine(runner, min_swap_tokens=4)
    stats = engine.stats()
    assert generated == reference
    # every swap call, out or in, found no memory and took the slow path
    assert runner.num_swap_ooms == stats.num_oom_events["swap"] > 0
    assert stats.num_oom_events["step"] == 0


def test_copy_blocks_fallback_copies_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # (layers, k/v, blocks, slots)
    src = torch.arange(2 * 2 * 5 * 3, dtype=torch.float32).reshape(2, 2, 5, 3)
    fast, slow = torch.zeros(2, 2, 4, 3), torch.zeros(2, 2, 4, 3)
    assert swap.copy_blocks(src, fast, [(4, 0), (1, 2)], torch.device("cpu")) is False

    def no_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(swap, "_copy_gathered", no_memory)
    assert swap.copy_blocks(src, slow, [(4, 0), (1, 2)], torch.device("cpu")) is True
    assert torch.equal(fast, slow)
    assert torch.equal(fast[:, :, 0], src[:, :, 4]) and torch.equal(fast[:, :, 2], src[:, :, 1])
    assert not fast[:, :, [1, 3]].any()


def test_forward_oom_is_retried_and_the_tokens_are_unchanged(
    checkpoint: Path, reference: dict[str, list[int]]
) -> None:
    runner = make_runner(checkpoint, num_blocks=40)
    forward = runner.model.forward
    calls = [0]

    def failing_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] in (3, 4):
            # what the step allocated before failing is held by this frame until it unwinds
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(*args, **kwargs)

    runner.model.forward = failing_forward  # type: ignore[method-assign]
    engine, generated = run_engine(runner)
    assert generated == reference
    stats = engine.stats()
    assert dict(stats.num_oom_events) == {"step": 2, "swap": 0, "startup": 0}
    assert (stats.num_failed_steps, stats.num_requests_success["length"]) == (0, 4)


def test_runner_turns_torch_oom_into_device_oom(checkpoint: Path) -> None:
    runner = make_runner(checkpoint, num_blocks=10)

    def no_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    runner.model.forward = no_memory  # type: ignore[method-assign]
    step = SchedulerOutput(seqs=[seq("a", tokens(5), 0, [1])], num_batched_tokens=5)
    with pytest.raises(DeviceOutOfMemoryError) as err:
        runner.execute(step)
    assert (err.value.kind, str(err.value)) == (
        "step",
        "CUDA out of memory. Tried to allocate 1.00 GiB",
    )
    assert err.value.__context__ is None  # the torch error and its frames are gone


def test_the_profiles_scratch_cache_is_freed_when_released(checkpoint: Path) -> None:
    """The layers' views must not keep the scratch alive: the real pool is allocated next."""
    runner = make_runner(checkpoint)
    target = runner.profile_target
    target.bind_scratch_cache(8)
    assert target.scratch is not None
    scratch = weakref.ref(target.scratch)
    target.release_scratch_cache()
    gc.collect()
    assert scratch() is None
    # The real pool is bound again for serving.
    runner.model.bind_kv_cache(runner.pools.layer_caches())
