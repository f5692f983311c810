"""The start-up profile: the worst-case and warm-up batches, and how the measurements are read."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.memory.budget import MemoryMeasurements
from pagekeeper_engine.memory.profile import (
    GREEDY_SAMPLING,
    PLAIN_SAMPLING,
    PROFILE_SAMPLING,
    ProfileShapes,
    measure_memory,
    num_scratch_blocks,
    warmup_batches,
    worst_case_batches,
)
from tests.engine.checkpoints import make_runner, write_checkpoint

SHAPES = ProfileShapes(max_num_batched_tokens=40, max_num_seqs=6, max_model_len=16, block_size=8)


def test_worst_case_is_a_full_prefill_then_a_full_decode() -> None:
    prefill, decode = worst_case_batches(SHAPES)
    # 40 tokens as max-model-len prompts of 16, 16 and 8, each on its own blocks
    assert [(s.num_tokens, s.start_pos, s.block_ids) for s in prefill.seqs] == [
        (16, 0, [0, 1]),
        (16, 0, [2, 3]),
        (8, 0, [4]),
    ]
    assert (prefill.num_tokens, prefill.num_sampled_rows) == (40, 6)
    assert [(s.num_tokens, s.start_pos, s.block_ids) for s in decode.seqs] == [
        (1, 7, [i]) for i in range(6)
    ]
    assert (decode.num_tokens, decode.num_sampled_rows) == (6, 6)
    assert all(s.sampling == PROFILE_SAMPLING and s.needs_sample for s in prefill.seqs)
    assert num_scratch_blocks(SHAPES) == 5 + 3  # the prefill's blocks and a spare per sequence


def test_warmup_mixes_smaller_shapes() -> None:
    batches = warmup_batches(SHAPES)
    assert [(b.num_tokens, b.num_sampled_rows) for b in batches] == [
        (23, 6),
        (2, 2),
        (6, 6),
        (1, 1),
        (30, 6),
        (3, 3),
    ]
    worst = max(b.num_tokens for b in worst_case_batches(SHAPES))
    assert all(b.num_tokens <= worst for b in batches)
    # each of the sampler's paths: top-k/top-p, greedy, plain temperature, greedy and plain mixed
    assert [{s.sampling for s in b.seqs} for b in batches] == [
        {PROFILE_SAMPLING},
        {GREEDY_SAMPLING},
        {PROFILE_SAMPLING},
        {PLAIN_SAMPLING},
        {PROFILE_SAMPLING},
        {GREEDY_SAMPLING, PLAIN_SAMPLING},
    ]
    # the lone decode sits at the end of the longest context: max-model-len here ...
    assert [(s.start_pos, s.block_ids) for s in batches[3].seqs] == [(15, [0, 1])]
    # ... or as much as the scratch blocks hold
    long = warmup_batches(ProfileShapes(40, 6, 1024, 8))[3]
    assert [(s.start_pos, s.block_ids) for s in long.seqs] == [(47, [0, 1, 2, 3, 4, 5])]
    assert num_scratch_blocks(ProfileShapes(40, 6, 1024, 8)) == 6


class FakeDevice:
    """An allocator whose peak grows with the batch and whose reserve grows with each shape."""

    def __init__(self) -> None:
        self.workspace_bytes = 100  # allocated with the model, before the profile
        self.current = 1000 + self.workspace_bytes  # the weights and the workspace
        self.peak = self.current
        self.reserved_bytes = 1200
        self.driver_bytes = 300  # outside the allocator
        self.calls: list[str] = []

    # ProfileTarget
    def bind_scratch_cache(self, num_blocks: int) -> int:
        self.calls.append(f"bind {num_blocks}")
        self.current += 50 * num_blocks
        return 50 * num_blocks

    def release_scratch_cache(self) -> None:
        self.calls.append("release")

    def capture_graphs(self) -> int:
        # a private pool of 70 bytes, and 25 bytes of instantiated graphs in the driver
        self.calls.append("capture")
        self.reserved_bytes += 70
        self.driver_bytes += 25
        return 70

    def release_graphs(self) -> None:
        self.calls.append("release graphs")

    def run_profile_batch(self, seqs: Sequence[ScheduledSeq], num_sampled_rows: int) -> None:
        num_tokens = sum(s.num_tokens for s in seqs)
        self.calls.append(f"batch {num_tokens}/{num_sampled_rows}")
        step_peak = self.current + 10 * num_tokens + 3 * num_sampled_rows
        self.peak = max(self.peak, step_peak)
        # each new shape strands 16 bytes beyond what the allocator held
        self.reserved_bytes = max(self.reserved_bytes, step_peak) + 16

    # MemoryReader
    def synchronize(self) -> None:
        pass

    def allocated(self) -> int:
        return self.current

    def max_allocated(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.current

    def reserved(self) -> int:
        return self.reserved_bytes

    def mem_get_info(self) -> tuple[int, int]:
        return 100_000 - self.reserved_bytes - self.driver_bytes, 100_000

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")


def test_measure_memory_reads_each_term_where_it_is_defined() -> None:
    device = FakeDevice()
    measured = measure_memory(device, device, SHAPES, free_at_start=99_000)
    # weights 1000 + workspace 100 + scratch 8 x 50; the worst step: 40 tokens x 10 + 6 rows x 3
    peak = 1000 + 100 + 400 + 400 + 18
    # 8 batches each strand 16 bytes; the largest step reserved `peak` first
    reserved = peak + 16 * 8
    assert measured == MemoryMeasurements(
        total=100_000,
        free_at_start=99_000,
        weights=1000,
        # the workspace is activations; the graphs' pool is held like them
        peak_activations=peak - 1000 - 400 + 70,
        non_torch=300 + 25,
        warmup_fragmentation=reserved - peak,
    )
    assert device.calls == [
        "bind 8",
        "batch 40/6",
        "batch 6/6",
        "batch 23/6",
        "batch 2/2",
        "batch 6/6",
        "batch 1/1",
        "batch 30/6",
        "batch 3/3",
        "capture",
        "release graphs",
        "release",
        "empty_cache",
    ]


def test_the_runner_profiles_its_worst_case_on_the_cpu(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    runner = make_runner(tmp_path, num_blocks=10, max_num_batched_tokens=96, max_num_seqs=5)
    shapes = ProfileShapes(96, 5, runner.max_model_len, runner.block_size)
    target = runner.profile_target
    device = FakeDevice()
    device.run_profile_batch = target.run_profile_batch  # type: ignore[method-assign]
    device.bind_scratch_cache = target.bind_scratch_cache  # type: ignore[method-assign]
    device.release_scratch_cache = target.release_scratch_cache  # type: ignore[method-assign]
    measured = measure_memory(device, device, shapes, free_at_start=99_000)
    assert measured.weights == 1000 and target.scratch is None
    # 2 layers, k and v, 14 blocks (96 / 8 + 2 prompts), 8 slots, 2 heads of 16 floats
    assert num_scratch_blocks(shapes) == 14
    assert target.bind_scratch_cache(14) == 2 * 2 * 14 * 8 * 2 * 16 * 4
    attn = runner.model.model.layers[0].self_attn
    assert attn.k_cache is not None and attn.k_cache.shape == (14, 8, 2, 16)
    with pytest.raises(AssertionError, match="block table too short"):
        target.run_profile_batch([ScheduledSeq("x", [0] * 9, 0, [0], True, PROFILE_SAMPLING, 0)], 1)
