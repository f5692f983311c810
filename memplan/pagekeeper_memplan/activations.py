"""The paged engine's preallocated step memory, computed from shapes: exact, not estimated.

The engine allocates everything a step works in once, before its start-up profile, which
counts it as activations (docs/decisions.md, "Sampling's rows are allocated once"):

- the activation workspace (`model/workspace.py`) for `max(max_num_batched_tokens,
  max_num_seqs)` tokens (the largest decode graph is `max_num_seqs` rows): residual and hidden
  (T, H), qkv (T, q + 2 kv), attn (T, q), gate_up (C, 2I) and act (C, I) with C = min(8192, T)
  in the model's dtype, and the one-token layer's fp32 statistics (2L + 1, H);
- the sampler's rows on rank 0 (`runner/sampler.py`): the logits in the model's dtype, three
  fp32 planes (draws, scores, a mixed batch's rows) of (max_num_seqs, V), the top-k / top-p
  cut's scratch of `2^20 // V` rows (`runner/top_k_top_p.py`) and the pick's scratch
  (`kernels/pick_scratch.py`);
- under tensor parallelism, every rank's vocabulary-shard picker (`runner/shard_pick.py`):
  its logits and draws over the shard, its pick scratch with every rank's partials, and on
  rank 0 the gathered logits of all shards.

Rank 0 holds the most of it, so the plan charges every rank rank 0's figure.
"""

from __future__ import annotations

import math

from pagekeeper_memplan.shape import ModelShape, RankShape

MLP_CHUNK_TOKENS = 8192  # model/workspace.py
CUT_CHUNK_ELEMENTS = 1 << 20  # runner/top_k_top_p.py
PICK_BLOCK_V = 2048  # kernels/pick_scratch.py
PICK_PLANES = 5
FP32, INT64, INT32, BOOL = 4, 8, 4, 1


def workspace_bytes(shape: ModelShape, tp: int, max_tokens: int, dtype_bytes: int) -> int:
    """The activation workspace of one rank for steps of up to `max_tokens` tokens."""
    rank = RankShape(shape, tp)
    hidden = shape.hidden_size
    chunk = min(MLP_CHUNK_TOKENS, max_tokens)
    elements = max_tokens * (2 * hidden + rank.q_size + 2 * rank.kv_size)
    elements += max_tokens * rank.q_size
    elements += chunk * 3 * rank.intermediate_size
    statistics = (2 * shape.num_layers + 1) * hidden * FP32
    return elements * dtype_bytes + statistics


def cut_scratch_bytes(max_rows: int, vocab: int) -> int:
    """The top-k / top-p cut's rows: sorted values and ids, probabilities, mass, mask."""
    rows = max(1, min(max_rows, CUT_CHUNK_ELEMENTS // max(vocab, 1)))
    per_row = vocab * (FP32 + INT64 + FP32 + FP32 + BOOL) + FP32
    return rows * per_row + vocab * INT64  # + the ranks' arange


def pick_scratch_bytes(max_rows: int, vocab: int, ranks: int = 1) -> int:
    """The token pick's outputs and per-chunk partials (with every rank's, gathered)."""
    partials = PICK_PLANES * max_rows * math.ceil(vocab / PICK_BLOCK_V) * FP32
    gathered = partials * ranks if ranks > 1 else 0
    counters = max_rows * INT32 if ranks == 1 else 0
    return max_rows * INT64 + 2 * max_rows * 8 + partials + gathered + counters


def sampler_bytes(vocab: int, max_rows: int, dtype_bytes: int, on_gpu: bool = True) -> int:
    """The sampler's rows on rank 0 (`SamplerBuffers`); the pick's scratch only on a GPU."""
    planes = max_rows * vocab * (dtype_bytes + 3 * FP32)
    pick = pick_scratch_bytes(max_rows, vocab) if on_gpu else 0
    return planes + cut_scratch_bytes(max_rows, vocab) + pick


def shard_picker_bytes(shape: ModelShape, tp: int, max_rows: int, dtype_bytes: int) -> int:
    """Rank 0's vocabulary-shard picker under tensor parallelism (0 on one GPU)."""
    if tp == 1:
        return 0
    width = RankShape(shape, tp).vocab_shard
    planes = max_rows * width * (dtype_bytes + FP32)
    gathered = tp * max_rows * width * dtype_bytes
    return planes + pick_scratch_bytes(max_rows, width, ranks=tp) + gathered


def step_buffers_bytes(
    shape: ModelShape, tp: int, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int
) -> int:
    """Rank 0's preallocated step memory: workspace, sampler rows and shard picker."""
    max_tokens = max(max_num_batched_tokens, max_num_seqs)
    return (
        workspace_bytes(shape, tp, max_tokens, dtype_bytes)
        + sampler_bytes(shape.vocab_size, max_num_seqs, dtype_bytes)
        + shard_picker_bytes(shape, tp, max_num_seqs, dtype_bytes)
    )
