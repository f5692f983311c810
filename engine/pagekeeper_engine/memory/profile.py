"""The start-up measurement behind the memory budget: what the model and its steps really take.

Runs on the device before the KV cache exists and after the runner's timed kernel choices (the
batch-1 GEMV, the fused layer), so it steps and captures the kernels serving runs, in this order:
1. weights: memory allocated once the model is loaded, less the steps' buffers that exist by
   then (the activation workspace of `model/workspace.py`, the sampler's rows, the cuBLAS
   workspaces the kernel timing left);
2. peak activations: the allocator's peak over the true worst-case steps (a prefill of
   `max_num_batched_tokens` tokens, then a decode of `max_num_seqs` sequences; logits and the
   sampler's worst case included), less the weights and the scratch KV cache they ran on: the
   workspace plus whatever a step still allocates beside it;
3. warm-up fragmentation: what the caching allocator reserves beyond that peak after a warm-up
   of mixed shapes (partial prefill chunks, smaller decode batches), i.e. what a serving day's
   varying shapes strand in its segments;
4. CUDA graphs: the decode graphs and the mixed steps' piecewise graphs are captured over the
   scratch cache; their private pool is held for the engine's life, so it joins the peak
   activations, and the driver's memory for the instantiated graphs shows up in the next term.
   They are released with the scratch cache (the runner captures them again over the real
   pool, at the same shapes and size);
5. non-torch memory: the device's used memory that the allocator does not hold (CUDA context,
   NCCL, loaded kernels, instantiated graphs, other processes).
`budget.compute_budget` turns these into a number of KV blocks. The model and the device come in
through the two protocols below, so this module stays free of torch and runs in CPU tests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.memory.budget import (
    KVLayout,
    MemoryBudget,
    MemoryMeasurements,
    compute_budget,
)

logger = logging.getLogger(__name__)

# top-k and top-p make the sampler sort the whole vocabulary: its worst case.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
# The sampler's other paths (each its own kernel variant), which the warm-up also runs.
GREEDY_SAMPLING = SamplingParams(temperature=0.0)
PLAIN_SAMPLING = SamplingParams(temperature=1.0)


class MemoryReader(Protocol):
    """Device-memory figures in bytes (`memory.cuda.CudaMemoryReader` on a GPU)."""

    def synchronize(self) -> None: ...

    def allocated(self) -> int: ...

    def max_allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def reserved(self) -> int: ...

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total)

    def empty_cache(self) -> None: ...


class ProfileTarget(Protocol):
    """The model runner as the profiler drives it."""

    @property
    def workspace_bytes(self) -> int:
        """Bytes the steps already hold beside the weights: the activation workspace, the
        sampler's rows, and what the runner's kernel timing left (cuBLAS's workspaces)."""
        ...

    def bind_scratch_cache(self, num_blocks: int) -> int:
        """Allocate a KV cache of `num_blocks` blocks, bind the model to it; its bytes."""
        ...

    def release_scratch_cache(self) -> None: ...

    def run_profile_batch(self, seqs: Sequence[ScheduledSeq], num_sampled_rows: int) -> None:
        """Forward `seqs`, then logits and sampling of `num_sampled_rows` rows."""
        ...

    def capture_graphs(self) -> int:
        """Capture the step graphs over the bound cache; their pool's bytes (0: none)."""
        ...

    def release_graphs(self) -> None: ...


@dataclass(frozen=True)
class ProfileShapes:
    """The limits that fix the worst case of one step."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int


@dataclass(frozen=True)
class ProfileBatch:
    """One profiling step: the sequences it runs and how many rows it samples."""

    seqs: list[ScheduledSeq]
    num_sampled_rows: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


def prefill_batch(num_tokens: int, shapes: ProfileShapes) -> ProfileBatch:
    """`num_tokens` prompt tokens as max-model-len prefills, sampling `max_num_seqs` rows (a
    step can sample that many: decodes riding along with a prefill chunk)."""
    seqs = []
    next_block = 0
    for start in range(0, num_tokens, shapes.max_model_len):
        length = min(shapes.max_model_len, num_tokens - start)
        num_blocks = math.ceil(length / shapes.block_size)
        block_ids = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        seqs.append(
            ScheduledSeq(f"profile-{start}", [0] * length, 0, block_ids, True, PROFILE_SAMPLING, 0)
        )
    return ProfileBatch(seqs, shapes.max_num_seqs)


def decode_batch(
    num_seqs: int,
    shapes: ProfileShapes,
    sampling: Sequence[SamplingParams] = (PROFILE_SAMPLING,),
) -> ProfileBatch:
    """`num_seqs` one-token decodes, each at the end of its own first block, sampled with the
    `sampling` settings in turn."""
    pos = min(shapes.block_size, shapes.max_model_len) - 1
    seqs = [
        ScheduledSeq(f"profile-{i}", [0], pos, [i], True, sampling[i % len(sampling)], 0)
        for i in range(num_seqs)
    ]
    return ProfileBatch(seqs, num_seqs)


def long_decode_batch(
    shapes: ProfileShapes, sampling: SamplingParams = PROFILE_SAMPLING
) -> ProfileBatch:
    """One decode at the longest context the scratch blocks hold (at most max-model-len): the
    shape whose attention splits its context, as a lone long request's decode does."""
    num_blocks = min(
        num_scratch_blocks(shapes), math.ceil(shapes.max_model_len / shapes.block_size)
    )
    pos = min(num_blocks * shapes.block_size, shapes.max_model_len) - 1
    seq = ScheduledSeq("profile-long", [0], pos, list(range(num_blocks)), True, sampling, 0)
    return ProfileBatch([seq], 1)


def worst_case_batches(shapes: ProfileShapes) -> list[ProfileBatch]:
    return [
        prefill_batch(shapes.max_num_batched_tokens, shapes),
        decode_batch(min(shapes.max_num_seqs, shapes.max_num_batched_tokens), shapes),
    ]


def warmup_batches(shapes: ProfileShapes) -> list[ProfileBatch]:
    """Shapes a serving day brings: partial chunks, smaller decode batches and a long decode,
    interleaved so that blocks freed by one shape are split by the next. Running them also
    compiles the kernels' variants before the first request (a split-context decode among
    them, and each of the sampler's paths: greedy, plain temperature, a mix of the two, and
    top-k/top-p), so none compiles while serving."""
    max_tokens = shapes.max_num_batched_tokens
    max_decodes = min(shapes.max_num_seqs, max_tokens)
    return [
        prefill_batch(max_tokens // 2 + 3, shapes),
        decode_batch(max(max_decodes // 3, 1), shapes, [GREEDY_SAMPLING]),
        prefill_batch(max_tokens // 7 + 1, shapes),
        long_decode_batch(shapes, PLAIN_SAMPLING),
        prefill_batch(max(max_tokens * 3 // 4, 1), shapes),
        decode_batch(max(max_decodes // 2, 1), shapes, [GREEDY_SAMPLING, PLAIN_SAMPLING]),
    ]


def num_scratch_blocks(shapes: ProfileShapes) -> int:
    """Blocks the profiling batches address: the largest of the prefill and decode tables."""
    num_prefill_seqs = math.ceil(shapes.max_num_batched_tokens / shapes.max_model_len)
    num_prefill_blocks = (
        math.ceil(shapes.max_num_batched_tokens / shapes.block_size) + num_prefill_seqs
    )
    return max(shapes.max_num_seqs, num_prefill_blocks)


def measure_memory(
    target: ProfileTarget, reader: MemoryReader, shapes: ProfileShapes, free_at_start: int
) -> MemoryMeasurements:
    """Profile the worst case and the warm-up; the measurements `compute_budget` needs.

    The scratch KV cache is neither activation nor slack: it is left out of the peak and held
    while the slack is read, then released with the allocator's cache. The graphs' pool is
    added to the peak; the device's free memory is read while the graphs exist.
    """
    reader.synchronize()
    weights = reader.allocated() - target.workspace_bytes
    scratch_bytes = target.bind_scratch_cache(num_scratch_blocks(shapes))
    try:
        reader.reset_peak()
        for batch in worst_case_batches(shapes):
            target.run_profile_batch(batch.seqs, batch.num_sampled_rows)
        reader.synchronize()
        peak_allocated = reader.max_allocated()
        for batch in warmup_batches(shapes):
            target.run_profile_batch(batch.seqs, batch.num_sampled_rows)
        reader.synchronize()
        reserved = reader.reserved()
        # Cached-but-free memory up to the peak is the activations' own, reused next step; only
        # what the allocator holds beyond the peak is lost to fragmentation.
        slack = max(reserved - reader.max_allocated(), 0)
        graph_bytes = target.capture_graphs()
        reader.synchronize()
        free, total = reader.mem_get_info()
        reserved_with_graphs = reader.reserved()
    finally:
        target.release_graphs()
        target.release_scratch_cache()
        reader.empty_cache()
    if graph_bytes:
        logger.info("start-up profile: CUDA graphs hold %d bytes", graph_bytes)
    return MemoryMeasurements(
        total=total,
        free_at_start=free_at_start,
        weights=weights,
        peak_activations=max(peak_allocated - weights - scratch_bytes, 0) + graph_bytes,
        non_torch=max(total - free - reserved_with_graphs, 0),
        warmup_fragmentation=slack,
    )


def size_kv_cache(
    target: ProfileTarget,
    reader: MemoryReader,
    shapes: ProfileShapes,
    layout: KVLayout,
    config: EngineConfig,
    free_at_start: int,
) -> MemoryBudget:
    """Measure, then decide the budget; logs every term. MemoryBudgetError when it cannot
    hold one max-model-len request or the device has less free than this instance asks for."""
    measured = measure_memory(target, reader, shapes, free_at_start)
    logger.info("start-up profile: %s", measured)
    budget = compute_budget(
        measured,
        layout,
        config.gpu_memory_utilization,
        config.fragmentation_buffer,
        shapes.max_model_len,
        config.kv_cache_memory_bytes,
    )
    logger.info("memory budget: %s; %d KV blocks", budget.describe(), budget.num_blocks)
    return budget
