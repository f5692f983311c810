# Triton kernels take untyped pointer and stride arguments by design.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Paged decode attention: one query token per sequence against its whole paged KV history.

One program handles one (sequence, KV head, split): the GROUP query heads that share the KV
head are packed into the rows of one tile, so each key tile is read once per group and the dot
products have >= 16 rows. For small batches the context is split across programs
(flash-decoding): each split writes a partial output and its log-sum-exp, and they are combined
either by a second (reduce) kernel or, given a buffer of split counters, by the last split of
each (sequence, KV head) to finish inside the same launch: it counts the finished splits with
one atomic, so at batch 1 a layer's attention is one launch instead of two. Split boundaries
are derived from each sequence's own length inside the kernel, so the number of splits changes
only speed, never the result. The number is a run-time argument, not a compile-time constant:
one compiled kernel serves every count an eager step may choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels import (
    FP8_CACHE_DTYPE,
    check_device,
    check_heads,
    check_index_tensor,
    check_paged_cache,
    dot_precision,
    next_power_of_2,
)
from pagekeeper_engine.kernels.decode_core import attend_tiles, decode_program, finish_split
from pagekeeper_engine.kernels.decode_splits import reduce_splits
from pagekeeper_engine.kernels.paged_kv import LOG2_E

MAX_SPLITS = 32
# A launch's splits: one per 128 tokens of its longest context (a CUDA graph's is the model's
# length), while (sequence, KV head) programs leave the GPU under-filled (`choose_num_splits`).
LAUNCH_TOKENS_PER_SPLIT = 128
# How many short splits a context may take before it takes long ones (`SplitRule`).
SHORT_SPLITS = 8


@dataclass(frozen=True)
class SplitRule:
    """How long a split is at a sequence's own length, with the reduce fused
    (`decode_core.decode_program`): at least `short_tokens` while the context fits `SHORT_SPLITS`
    of them, else at least `long_tokens`.

    A split's serial tiles are each a chain of dependent loads from DRAM, and more splits run those
    chains side by side; the combine then passes over more partials. In the engine at batch 1 on an
    H200, 64-token splits took 45-50 us off a Qwen3-0.6B step and ~20 us off a Llama-3.1-8B one at
    128-428-token contexts, against 128; at 1,700-2,000 tokens 32 splits of 64 cost 55-80 us a step
    against 16 of 128 (docs/benchmarks-archive.md, "decode splits sized for a KV cache in DRAM"; an
    earlier sweep, which favoured 128 everywhere, timed a KV cache that stayed in L2). So the short
    splits stop at 8 of them, within what was measured."""

    short_tokens: int = 64
    long_tokens: int = LAUNCH_TOKENS_PER_SPLIT

    def __post_init__(self) -> None:
        assert 1 <= self.short_tokens <= self.long_tokens, f"split tokens out of order: {self}"


SPLIT_RULE = SplitRule()  # what the engine's decode launches use


# Arguments whose alignment or value changes from step to step (see kernels/__init__.py). The
# split count is one: an eager step chooses it from its batch and its longest context, so as a
# compile-time constant it would compile a variant per count in the middle of serving.
STEP_VARYING = (
    "block_tables_ptr", "seq_lens_ptr", "counters_ptr", "block_table_stride", "num_splits",
    "short_split_tokens", "long_split_tokens",
)  # fmt: skip


@triton.jit(do_not_specialize=STEP_VARYING)
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,  # (B, num_heads, num_splits, HEAD_DIM) fp32, unused unless IS_SPLIT
    part_lse_ptr,  # (B, num_heads, num_splits) fp32 log2-sum-exp2 of the scaled scores
    counters_ptr,  # (>= B * NUM_KV_HEADS,) int32 zeros, used when FUSED_REDUCE; left zero
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    block_table_stride,
    scale_log2,  # softmax scale * log2(e) (* an FP8 cache's key scale): scores go through exp2
    v_scale,  # an FP8 cache's value scale (1.0 otherwise): the output's factor
    num_splits,  # programs along the context (axis 2), >= 2 exactly when IS_SPLIT
    short_split_tokens,  # FUSED_REDUCE: the fewest tokens a split covers (`SplitRule`)
    long_split_tokens,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    SHORT_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # an FP8 cache: the dots run in fp16 (FP8 widens to it natively)
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent: wait before any access
):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq, kv_head, split, _, live, start, end = decode_program(
        seq_lens_ptr, num_splits, short_split_tokens, long_split_tokens, BLOCK_N, FUSED_REDUCE,
        SHORT_SPLITS,
    )  # fmt: skip
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    # (GROUP_PAD, HEAD_DIM): padding rows are zero and never stored.
    q = tl.load(
        q_ptr + seq * q_token_stride + heads[:, None] * q_head_stride + offs_d[None, :],
        mask=(offs_g < GROUP)[:, None],
        other=0.0,
    )
    if KV_FP8:
        q = q.to(tl.float16)
    acc, m_i, l_i = attend_tiles(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * block_table_stride, kv_head,
        start, end, scale_log2, NUM_KV_HEADS, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
        DOT_PRECISION,
    )  # fmt: skip
    finish_split(
        acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, counters_ptr, seq, kv_head, split,
        live, num_splits, out_token_stride, out_head_stride, v_scale, NUM_KV_HEADS, GROUP,
        GROUP_PAD, HEAD_DIM, IS_SPLIT, FUSED_REDUCE,
    )  # fmt: skip


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, waves: float = 2.0
) -> int:
    """Split the context only while (sequence, KV head) programs leave the GPU under-filled."""
    num_programs = num_seqs * num_kv_heads
    wanted = -(-int(waves * num_sms) // num_programs)
    by_length = -(-max_seq_len // LAUNCH_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def paged_decode(
    q: torch.Tensor,  # (B, num_heads, head_dim): one query token per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks_per_seq) int32
    seq_lens: torch.Tensor,  # (B,) int32, each >= 1, including the query token
    scale: float,
    out: torch.Tensor | None = None,  # (B, num_heads, head_dim); may be a strided view
    num_splits: int = 1,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    split_counters: torch.Tensor | None = None,  # (>= B * num_kv_heads,) int32, all zero
    k_scale: float = 1.0,  # the cache holds value / scale: keys and values are that times it
    v_scale: float = 1.0,
    split_rule: SplitRule = SPLIT_RULE,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of each sequence's last token over its `seq_lens[b]` cached tokens.

    With `split_counters` (zeros, left zero) the splits are combined inside the one launch;
    without, by a second kernel. Same arithmetic either way. With the fused reduce a split is as
    long as `split_rule` says at the sequence's length and a sequence uses only the splits its
    tokens reach, so a launch whose split count was chosen for a longer context wastes no work
    on a short one. `pdl` launches it as a programmatic dependent of the kernel before it
    (Hopper and later).
    """
    launch = prepare_decode(
        q, k_cache, v_cache, block_tables, seq_lens, out, num_splits, block_n, split_counters,
    )  # fmt: skip
    if launch.num_seqs == 0:
        return launch.out
    _paged_decode_kernel[launch.grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        launch.out,
        launch.part_out,
        launch.part_lse,
        launch.counters,
        q.stride(0),
        q.stride(1),
        launch.out.stride(0),
        launch.out.stride(1),
        block_tables.stride(0),
        scale * LOG2_E * k_scale,
        v_scale,
        num_splits,
        split_rule.short_tokens,
        split_rule.long_tokens,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch.constants,
        **({"launch_pdl": True} if pdl else {}),
    )
    if num_splits > 1 and not launch.fused_reduce:
        reduce_splits(launch.part_out, launch.part_lse, launch.out, launch.num_kv_heads)
    return launch.out


@dataclass(frozen=True)
class DecodeLaunch:
    """What a decode launcher passes its kernel besides its own inputs (`prepare_decode`)."""

    out: torch.Tensor
    part_out: torch.Tensor  # (B, num_heads, num_splits, head_dim) fp32 (`out` when unsplit)
    part_lse: torch.Tensor  # (B, num_heads, num_splits) fp32
    counters: torch.Tensor  # the split counters (with the reduce fused; else never touched)
    grid: tuple[int, int, int]  # (KV heads, sequences, splits): `decode_core.decode_program`
    fused_reduce: bool
    constants: dict[str, Any]  # the kernel's compile-time arguments of the shapes

    @property
    def num_kv_heads(self) -> int:
        return self.grid[0]

    @property
    def num_seqs(self) -> int:
        return self.grid[1]


def prepare_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    num_splits: int,
    block_n: int,
    split_counters: torch.Tensor | None,
) -> DecodeLaunch:
    """Check a decode launch's arguments (`paged_decode`'s) and make its output and partials."""
    _, block_size, num_kv_heads, head_dim = check_paged_cache(k_cache, v_cache)
    num_heads = check_heads("q", q, num_kv_heads, head_dim, k_cache.dtype)
    num_seqs = int(q.shape[0])
    check_index_tensor("block_tables", block_tables, 2, torch.int32)
    check_index_tensor("seq_lens", seq_lens, 1, torch.int32)
    assert block_tables.shape[0] == num_seqs, (
        f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences"
    )
    assert seq_lens.shape[0] == num_seqs, (
        f"seq_lens has {seq_lens.shape[0]} entries, not {num_seqs}"
    )
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape, f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}"
    assert out.dtype == q.dtype, f"out is {out.dtype}, q is {q.dtype}"
    assert out.stride(2) == 1, "out must be contiguous in head_dim"
    for name, tensor in (("q", q), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        check_device(name, tensor, k_cache.device)
    check_device("out", out, k_cache.device)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits {num_splits} outside [1, {MAX_SPLITS}]"
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n {block_n} not a power of 2"
    if split_counters is not None:
        check_index_tensor("split_counters", split_counters, 1, torch.int32)
        check_device("split_counters", split_counters, k_cache.device)
        assert split_counters.shape[0] >= num_seqs * num_kv_heads, (
            f"split_counters has {split_counters.shape[0]} entries, fewer than "
            f"{num_seqs} sequences x {num_kv_heads} KV heads"
        )
    fused_reduce = num_splits > 1 and split_counters is not None
    part_out = part_lse = out  # never read unsplit: the kernel writes `out` directly
    if num_splits > 1 and num_seqs > 0:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    group = num_heads // num_kv_heads
    return DecodeLaunch(
        out=out,
        part_out=part_out,
        part_lse=part_lse,
        counters=split_counters if fused_reduce and split_counters is not None else seq_lens,
        grid=(num_kv_heads, num_seqs, num_splits),
        fused_reduce=fused_reduce,
        constants={
            "NUM_KV_HEADS": num_kv_heads,
            "GROUP": group,
            "GROUP_PAD": max(16, next_power_of_2(group)),
            "HEAD_DIM": head_dim,
            "BLOCK_SIZE": block_size,
            "BLOCK_N": block_n,
            "IS_SPLIT": num_splits > 1,
            "FUSED_REDUCE": fused_reduce,
            "SHORT_SPLITS": SHORT_SPLITS,
            "DOT_PRECISION": dot_precision(q.dtype),
            "KV_FP8": k_cache.dtype == FP8_CACHE_DTYPE,
        },
    )
