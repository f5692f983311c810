"""Plain torch references for the paged kernels: slow, obvious, and computed in fp32.

Tests compare each Triton kernel with these on the same inputs; nothing in the engine's hot path
calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def write_kv_ref(
    k: torch.Tensor,  # (T, num_kv_heads, head_dim)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64; negative entries are skipped
) -> None:
    is_real = slot_mapping >= 0
    slots = slot_mapping[is_real]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[is_real]
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[is_real]


def gather_sequence_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (max_blocks_per_seq,) int
    seq_len: int,
) -> torch.Tensor:  # (seq_len, num_kv_heads, head_dim)
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    block_ids = block_table.long()[positions // block_size]
    return cache[block_ids, positions % block_size]


def paged_attention_ref(
    q: torch.Tensor,  # (T, num_heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (S, max_blocks_per_seq) int32
    seq_lens: torch.Tensor,  # (S,) int32
    query_start_loc: torch.Tensor,  # (S + 1,) int32
    scale: float,
) -> torch.Tensor:  # (T, num_heads, head_dim) in q's dtype; rows outside the ranges are zero
    """Causal attention of each sequence's query rows over its cached keys, one at a time."""
    out = torch.zeros_like(q)
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[seq], starts[seq + 1])
        q_len = starts[seq + 1] - starts[seq]
        keys = gather_sequence_kv(k_cache, block_tables[seq], seq_len).float()
        values = gather_sequence_kv(v_cache, block_tables[seq], seq_len).float()
        keys = keys.repeat_interleave(group, dim=1)  # (seq_len, num_heads, head_dim)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        is_visible = key_pos[None, :] <= query_pos[:, None]  # (q_len, seq_len)
        scores = scores.masked_fill(~is_visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def paged_decode_ref(
    q: torch.Tensor,  # (B, num_heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode is attention with one query row per sequence, at the sequence's last position."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's RMSNorm: sum rounded to dtype, fp32 statistics, weight multiply in dtype."""
    summed = x + residual if residual is not None else None
    source = summed if summed is not None else x
    x32 = source.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), summed


def rotary_ref(
    x: torch.Tensor,  # (T, heads, head_dim)
    positions: torch.Tensor,  # (T,)
    cos: torch.Tensor,  # (max_position, head_dim // 2) fp32
    sin: torch.Tensor,
) -> torch.Tensor:
    """Neox-style rotation of the two halves of each head, in fp32."""
    cos_t = cos[positions].unsqueeze(1)
    sin_t = sin[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos_t - x2 * sin_t, x2 * cos_t + x1 * sin_t), dim=-1).to(x.dtype)


def quantize_fp8_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 KV cache stores for `x` at `scale`: x / scale in e4m3 (round to nearest,
    saturating at +-448 as the kernels' conversion does; torch's own cast gives NaN there)."""
    limit = torch.finfo(torch.float8_e4m3fn).max
    return (x.float() / scale).clamp(-limit, limit).to(torch.float8_e4m3fn)


def dequantize_fp8_ref(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """The value an FP8 cache entry stands for: stored x scale, in fp32."""
    return stored.float() * scale


_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)  # Philox4x32's key increments
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)  # and its round multipliers
_MASK32 = 0xFFFFFFFF


def uniforms_ref(key: int, num_rows: int) -> torch.Tensor:
    """`tl.rand(key, row)` for rows 0..num_rows-1, (N,) fp32 on the CPU (`keyed_uniforms_ref`
    with every row's key `key` and its counter the row)."""
    return keyed_uniforms_ref([key] * num_rows, list(range(num_rows)))


def keyed_uniforms_ref(keys: Sequence[int], counters: Sequence[int]) -> torch.Tensor:
    """`tl.rand(keys[r], counters[r])` for each r, (N,) fp32 on the CPU: lane 0 of
    Philox4x32-10 of the counter (its low and high 32 bits, 0, 0) under the key (its low and high
    32 bits), as int32 with negatives complemented, times 4.6566127342e-10 (Triton's
    `uint_to_uniform_float`): uniform in [0, 1). Keys and counters are in [0, 2**63) (numpy
    arrays of them are taken as they are)."""
    import numpy as np  # noqa: PLC0415  (the references alone use numpy's exact uint64 products)

    mask = np.uint64(_MASK32)
    rows = np.asarray(counters, dtype=np.uint64)
    key_words = np.asarray(keys, dtype=np.uint64)
    assert rows.shape == key_words.shape, "a key and a counter each"
    zero = rows * np.uint64(0)
    c = [rows & mask, rows >> np.uint64(32), zero, zero]
    k0, k1 = key_words & mask, (key_words >> np.uint64(32)) & mask
    round_a, round_b = np.uint64(_PHILOX_ROUND[0]), np.uint64(_PHILOX_ROUND[1])
    for _ in range(10):
        product_b, product_a = round_b * c[2], round_a * c[0]  # exact: both factors < 2**32
        c = [
            (product_b >> np.uint64(32)) ^ c[1] ^ k0,
            product_b & mask,
            (product_a >> np.uint64(32)) ^ c[3] ^ k1,
            product_a & mask,
        ]
        k0 = (k0 + np.uint64(_PHILOX_KEY[0])) & mask
        k1 = (k1 + np.uint64(_PHILOX_KEY[1])) & mask
    lane = c[0].astype(np.uint32).view(np.int32)
    lane = np.where(lane < 0, ~lane, lane).astype(np.float32)
    return torch.from_numpy(lane * np.float32(4.6566127342e-10))


def inverse_cdf_ref(
    scores: torch.Tensor,  # (N, V) fp32 or raw's dtype
    raw: torch.Tensor,  # (N, V): the model's unmodified logits
    *,
    scale: float,
    uniforms: torch.Tensor,  # (N,) in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.sampling.pick_tokens` with a sample key, in plain torch (fp64), at `uniforms`
    (`uniforms_ref` of the key): row r's token is the first whose cumulative softmax(scores *
    scale) mass exceeds uniforms[r] times the row's mass (never one of zero mass; the last with
    mass where rounding leaves none past the target; token 0 for a row of no mass)."""
    race = scores.double() * scale
    shift = race.max(dim=-1, keepdim=True).values
    weight = (race - shift.masked_fill(shift.isinf(), 0.0)).exp()
    cdf = weight.cumsum(dim=-1)
    target = uniforms.double()[:, None] * cdf[:, -1:]
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    columns = torch.arange(weight.shape[1], device=weight.device)
    last = torch.where(weight > 0, columns, 0).max(dim=-1).values
    token_ids = torch.where(token_ids >= weight.shape[1], last, token_ids)
    wide = raw.float()
    logprobs = wide.gather(1, token_ids[:, None]).squeeze(1) - wide.logsumexp(dim=-1)
    return token_ids, torch.stack((token_ids.double(), logprobs.double()))


def gemv_fp8_ref(
    x: torch.Tensor,  # (1, K)
    weight: torch.Tensor,  # (N, K) e4m3
    weight_scale: torch.Tensor,  # (N,) fp32
    bias: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:
    """`kernels.gemv.gemv` with `weight_scale`, in fp32: x (weight * scale[:, None])^T + bias;
    the kernel's result is this rounded once to x's dtype."""
    dequantized = weight.float() * weight_scale[:, None]
    return torch.nn.functional.linear(
        x.float(), dequantized, None if bias is None else bias.float()
    )


def gather_blocks_ref(pool_words: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`kernels.block_copy.gather_blocks`: the blocks of (chunks, num_blocks, chunk) words as
    (n, chunks, chunk)."""
    return pool_words[:, block_ids].transpose(0, 1).contiguous()


def scatter_blocks_ref(
    src: torch.Tensor, block_ids: torch.Tensor, pool_words: torch.Tensor
) -> None:
    """`kernels.block_copy.scatter_blocks`: the inverse of `gather_blocks_ref`, in place."""
    pool_words[:, block_ids] = src.transpose(0, 1)


def seeded_noise_ref(
    noise: torch.Tensor,  # (R, >= width) fp32, written in place
    rows: list[int],
    keys: list[int],  # each row's Philox key, in [0, 2**63)
    col_offset: int,  # the first column's index in the whole vocabulary
    width: int,
) -> None:
    """`kernels.seeded_noise.seeded_noise` in numpy and torch: row rows[i]'s columns 0..width-1
    get -log(1 - U), U = `keyed_uniforms_ref` at key keys[i] and counter col_offset + column."""
    import numpy as np  # noqa: PLC0415

    assert len(rows) == len(keys), "a key for each seeded row"
    if not rows or width == 0:
        return
    counters = np.tile(np.arange(col_offset, col_offset + width, dtype=np.uint64), len(rows))
    row_keys = np.repeat(np.asarray(keys, dtype=np.uint64), width)
    uniforms = keyed_uniforms_ref(row_keys, counters).view(len(rows), width)  # type: ignore[arg-type]
    noise[rows, :width] = (-torch.log(1.0 - uniforms)).to(noise.device)
