"""The model runner: owns the model, the KV cache pool, the swap pool and the sampler.

It consumes the scheduler's plain `SchedulerOutput`, turns it into packed tensors and
`AttentionMetadata`, runs the forward pass, computes logits only for the rows that are sampled,
and returns plain token ids. It makes no scheduling decision of its own.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagekeeper_engine.attention.base import AttentionMetadata
from pagekeeper_engine.attention.registry import get_backend
from pagekeeper_engine.config import EngineConfig, resolve_max_num_batched_tokens
from pagekeeper_engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from pagekeeper_engine.core.sampling import SamplingParams
from pagekeeper_engine.memory.budget import (
    KVLayout,
    MemoryBudget,
    MemoryMeasurements,
    compute_budget,
)
from pagekeeper_engine.model.hf_config import ModelConfig, load_eos_token_ids, load_model_config
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.model.loader import load_model, resolve_dtype
from pagekeeper_engine.sampler import Sampler

logger = logging.getLogger(__name__)

CPU_KV_MEMORY_FRACTION = 0.25  # at most this share of host RAM for the KV cache on the CPU


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"--max-model-len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings {limit} (config.json)"
        )
    return config.max_model_len


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across every layer, keys and values."""
    per_token = 2 * model_config.num_layers * model_config.kv_size * dtype.itemsize
    return per_token * block_size


def num_cpu_kv_blocks(
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    bytes_per_block: int,
    host_memory_bytes: int,
) -> int:
    """Blocks for a CPU run: every sequence at full length, bounded by a share of host RAM."""
    wanted = math.ceil(max_num_seqs * max_model_len / block_size)
    affordable = int(host_memory_bytes * CPU_KV_MEMORY_FRACTION) // bytes_per_block
    num_blocks = min(wanted, affordable)
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the CPU KV cache budget ({affordable} blocks of {bytes_per_block} bytes, "
            f"{CPU_KV_MEMORY_FRACTION:.0%} of host memory) cannot hold one --max-model-len "
            f"{max_model_len} request; lower --max-model-len or set --num-gpu-blocks-override"
        )
    return num_blocks


@dataclass
class StepInputs:
    """The packed tensors of one step, on the runner's device."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # (N,) int64: rows of the hidden states to compute logits for
    sampled_seqs: list[int]  # (N,) index into the step's seqs of each sampled row


class ModelRunner:
    """Runs scheduled steps of one model on one device over a preallocated paged KV cache."""

    def __init__(self, config: EngineConfig, *, progress: bool = True):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            self._free_at_start = torch.cuda.mem_get_info(self.device)[0]
        self.memory_budget: MemoryBudget | None = None
        model_dir = Path(config.model)
        self.model_config = load_model_config(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype, config.device)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(
            config.max_num_batched_tokens, config.enable_chunked_prefill, self.max_model_len
        )
        self.block_size = config.block_size
        self.eos_token_ids = load_eos_token_ids(model_dir)
        self.model: CausalLM = load_model(
            self.model_config,
            model_dir,
            load_format=config.load_format,
            dtype=self.dtype,
            device=config.device,
            backend=get_backend(config.device),
            max_position=self.max_model_len,
            seed=config.seed,
            progress=progress,
        )
        self.sampler = Sampler(self.device, config.seed, self.eos_token_ids)
        self.bytes_per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)

        self.num_gpu_blocks = self._decide_num_gpu_blocks()
        # One pool for all layers: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).
        # Zero-filled so a kernel that reads a whole block never meets NaN garbage.
        self.kv_pool = torch.zeros(
            self._pool_shape(self.num_gpu_blocks), dtype=self.dtype, device=self.device
        )
        self.model.bind_kv_cache([(layer[0], layer[1]) for layer in self.kv_pool])

        self.num_cpu_blocks = (
            config.num_cpu_blocks_override
            if config.num_cpu_blocks_override is not None
            else int(config.swap_space * 2**30) // self.bytes_per_block
        )
        self.cpu_pool = torch.zeros(
            self._pool_shape(self.num_cpu_blocks),
            dtype=self.dtype,
            pin_memory=self.device.type == "cuda",
        )
        logger.info(
            "KV cache: %d device blocks, %d swap blocks of %d tokens (%d bytes per block)",
            self.num_gpu_blocks,
            self.num_cpu_blocks,
            self.block_size,
            self.bytes_per_block,
        )

    def _pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        cfg = self.model_config
        return (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)

    def _decide_num_gpu_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cpu":
            host_memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return num_cpu_kv_blocks(
                max_num_seqs=self.config.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                bytes_per_block=self.bytes_per_block,
                host_memory_bytes=host_memory,
            )
        return self._budget_num_gpu_blocks()

    def _budget_num_gpu_blocks(self) -> int:
        """Measure, then size the KV cache with the budget arithmetic of `memory/budget.py`."""
        cfg = self.model_config
        layout = KVLayout(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.block_size, self.dtype.itemsize
        )
        self.memory_budget = compute_budget(
            self._measure_memory(),
            layout,
            self.config.gpu_memory_utilization,
            self.config.fragmentation_buffer,
            self.max_model_len,
        )
        logger.info("memory budget: %s", self.memory_budget.describe())
        return self.memory_budget.num_blocks

    @property
    def memory_budget_bytes(self) -> dict[str, int] | None:
        """The start-up budget's terms (None when the block count was given or on the CPU)."""
        return None if self.memory_budget is None else self.memory_budget.terms

    @torch.inference_mode()
    def _measure_memory(self) -> MemoryMeasurements:
        """Weights, the worst-case step's peak, memory outside torch, and what the allocator
        reserved beyond that peak over a warm-up of mixed shapes. Memory of other processes
        counts as non-torch: the budget errs towards using less."""
        dev = self.device
        max_tokens, max_seqs = self.max_num_batched_tokens, self.config.max_num_seqs
        torch.cuda.synchronize(dev)
        weights = torch.cuda.memory_allocated(dev)
        # One scratch cache serves every profile step. It is neither activation nor slack, so
        # it is left out of the peak and held while the slack is read.
        num_prefill_seqs = math.ceil(max_tokens / self.max_model_len)
        num_scratch_blocks = max(
            max_seqs, math.ceil(max_tokens / self.block_size) + num_prefill_seqs
        )
        scratch = torch.zeros(self._pool_shape(num_scratch_blocks), dtype=self.dtype, device=dev)
        self.model.bind_kv_cache([(layer[0], layer[1]) for layer in scratch])
        torch.cuda.reset_peak_memory_stats(dev)
        self._profile_step(max_tokens, is_decode=False)
        self._profile_step(max_seqs, is_decode=True)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - weights - scratch.nbytes
        # Shapes a serving day brings: partial chunks and smaller decode batches.
        for num_tokens, is_decode in (
            (max_tokens // 2 + 3, False),
            (max(max_seqs // 3, 1), True),
            (max_tokens // 7 + 1, False),
            (1, True),
        ):
            self._profile_step(num_tokens, is_decode=is_decode)
        torch.cuda.synchronize(dev)
        reserved = torch.cuda.memory_reserved(dev)
        # Cached-but-free memory up to the peak is the activations' own, reused next step; only
        # what the allocator holds beyond the peak is lost to fragmentation.
        slack = max(reserved - torch.cuda.max_memory_allocated(dev), 0)
        free, total = torch.cuda.mem_get_info(dev)
        del scratch
        torch.cuda.empty_cache()
        return MemoryMeasurements(
            total=total,
            free_at_start=self._free_at_start,
            weights=weights,
            peak_activations=peak,
            non_torch=max(total - free - reserved, 0),
            warmup_fragmentation=slack,
        )

    def _profile_step(self, num_tokens: int, *, is_decode: bool) -> None:
        """A forward of num_tokens tokens (prefill chunks, or one-token decodes) on the bound
        scratch cache, then sampling of its rows (at least --max-num-seqs for a prefill)."""
        # top-k and top-p make the sampler sort the whole vocabulary: its worst case.
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        bs = self.block_size
        seqs: list[ScheduledSeq] = []
        if is_decode:
            pos = min(bs, self.max_model_len) - 1
            for i in range(num_tokens):
                seqs.append(ScheduledSeq(f"profile-{i}", [0], pos, [i], True, params, 0))
        else:
            next_block = 0
            for start in range(0, num_tokens, self.max_model_len):
                length = min(self.max_model_len, num_tokens - start)
                blocks = list(range(next_block, next_block + math.ceil(length / bs)))
                next_block += len(blocks)
                seqs.append(
                    ScheduledSeq(f"profile-{start}", [0] * length, 0, blocks, True, params, 0)
                )
        step = self.prepare_inputs(seqs)
        hidden = self.model(step.input_ids, step.positions, step.meta)
        num_rows = num_tokens if is_decode else self.config.max_num_seqs
        rows = torch.arange(num_rows, device=self.device) % hidden.shape[0]
        logits = self.model.compute_logits(hidden[rows])
        self.sampler(logits, [params] * num_rows, [0] * num_rows)

    # -- one step ----------------------------------------------------------------------------

    def prepare_inputs(self, seqs: Sequence[ScheduledSeq]) -> StepInputs:
        """Pack the step's sequences (decodes first) into tensors and attention metadata."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_indices: list[int] = []
        sampled_seqs: list[int] = []
        for i, seq in enumerate(seqs):
            end = seq.start_pos + seq.num_tokens
            assert seq.num_tokens > 0, f"{seq.request_id}: a scheduled sequence has tokens"
            assert end <= self.max_model_len, f"{seq.request_id}: {end} > max_model_len"
            assert len(seq.block_ids) * bs >= end, f"{seq.request_id}: block table too short"
            input_ids.extend(seq.token_ids)
            for pos in range(seq.start_pos, end):
                positions.append(pos)
                slots.append(seq.block_ids[pos // bs] * bs + pos % bs)
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if seq.needs_sample:
                sample_indices.append(len(input_ids) - 1)
                sampled_seqs.append(i)
        width = max(len(seq.block_ids) for seq in seqs)
        block_tables = [seq.block_ids + [0] * (width - len(seq.block_ids)) for seq in seqs]
        num_decode_seqs = 0
        while num_decode_seqs < len(seqs) and seqs[num_decode_seqs].num_tokens == 1:
            num_decode_seqs += 1
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(block_tables, torch.int32),
            max_query_len=max(seq.num_tokens for seq in seqs),
            max_seq_len=max(seq_lens),
            num_decode_seqs=num_decode_seqs,
        )
        return StepInputs(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            meta=meta,
            sample_indices=self._tensor(sample_indices, torch.int64),
            sampled_seqs=sampled_seqs,
        )

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Apply the step's swaps, run the forward pass, sample where asked."""
        if out.blocks_to_swap_out:
            self.swap_blocks(out.blocks_to_swap_out, to_cpu=True)
        if out.blocks_to_swap_in:
            self.swap_blocks(out.blocks_to_swap_in, to_cpu=False)
        if not out.seqs:
            return RunnerOutput(sampled_token_ids=[], logprobs=[])
        step = self.prepare_inputs(out.seqs)
        hidden = self.model(step.input_ids, step.positions, step.meta)  # (T, H)
        token_ids: list[int | None] = [None] * len(out.seqs)
        logprobs: list[float | None] = [None] * len(out.seqs)
        if step.sampled_seqs:
            logits = self.model.compute_logits(hidden[step.sample_indices])  # (N, V)
            picked = [out.seqs[i] for i in step.sampled_seqs]
            result = self.sampler(
                logits, [s.sampling for s in picked], [s.num_output_tokens for s in picked]
            )
            for row, i in enumerate(step.sampled_seqs):
                token_ids[i] = result.token_ids[row]
                logprobs[i] = result.logprobs[row]
        return RunnerOutput(sampled_token_ids=token_ids, logprobs=logprobs)

    @torch.inference_mode()
    def swap_blocks(self, src_to_dst: Sequence[tuple[int, int]], *, to_cpu: bool) -> None:
        """Copy whole blocks (every layer, keys and values) between the device and swap pools."""
        if not src_to_dst:
            return
        src = torch.tensor([s for s, _ in src_to_dst], dtype=torch.int64)
        dst = torch.tensor([d for _, d in src_to_dst], dtype=torch.int64)
        if to_cpu:
            assert int(dst.max()) < self.num_cpu_blocks, "swap-out target beyond the swap pool"
            moved = self.kv_pool[:, :, src.to(self.device)].to("cpu")
            self.cpu_pool[:, :, dst] = moved
        else:
            assert int(dst.max()) < self.num_gpu_blocks, "swap-in target beyond the KV pool"
            moved = self.cpu_pool[:, :, src].to(self.device)
            self.kv_pool[:, :, dst.to(self.device)] = moved
