"""The CUDA attention backend: Triton kernels over the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch

from pagekeeper_engine.attention.base import (
    UNSCALED,
    AttentionBackend,
    AttentionMetadata,
    KVScales,
    QKNorm,
    RotaryTables,
)
from pagekeeper_engine.kernels import FP8_CACHE_DTYPE, is_interpreter
from pagekeeper_engine.kernels.kv_write import rotate_and_write_kv, write_kv
from pagekeeper_engine.kernels.paged_decode import choose_num_splits, paged_decode
from pagekeeper_engine.kernels.paged_prefill import paged_prefill
from pagekeeper_engine.kernels.rotary_decode import rotary_decode

_INTERPRETER_NUM_SMS = 4
# Split counters for the decode kernel's in-launch reduce: splits are only chosen while
# (sequences x KV heads) programs under-fill the GPU, far fewer than this.
_MAX_SPLIT_COUNTERS = 4096
# The one-launch decode saves a launch a layer, which pays where launches dominate: at 1-64
# sequences it was 0.04-1.6 us a layer faster than the rotary write and the decode in a row, at
# 128-256 it was 0.9-3.1 us slower (each program norms and rotates its heads before its first
# load; docs/benchmarks-archive.md, "rotary, KV write and attention in one launch").
ONE_LAUNCH_MAX_SEQS = 64


class TritonAttentionBackend(AttentionBackend):
    """Writes k/v with one kernel, then runs decode rows through the split-KV decode kernel and
    prefill/extend rows through the paged prefill kernel, into one output tensor.

    The number of decode splits depends only on the batch's shape and `meta.max_seq_len`; the
    kernel derives each split's range from the sequence's own length, so a CUDA graph captured
    at one `max_seq_len` stays correct at any other. The splits are combined inside the decode
    launch (counters that the kernel leaves at zero, allocated on the first call, which the
    runner makes eagerly before any graph capture).

    `write_rotary` applies the rotary embedding (and Qwen3's q/k norm) in the KV-write kernel,
    norming and rotating q in place, so a layer's rotary, KV write and decode attention are two
    launches, not four (six with the q/k norm); at a step of up to `ONE_LAUNCH_MAX_SEQS` decodes
    alone `forward_rotary` makes them one (`kernels/rotary_decode.py`).
    """

    name = "triton"

    def __init__(self, num_sms: int | None = None) -> None:
        if num_sms is None:
            if torch.cuda.is_available() and not is_interpreter():
                num_sms = torch.cuda.get_device_properties(
                    torch.cuda.current_device()
                ).multi_processor_count
            else:
                num_sms = _INTERPRETER_NUM_SMS
        self.num_sms = num_sms
        self._split_counters: torch.Tensor | None = None

    def _counters(self, device: torch.device) -> torch.Tensor:
        if self._split_counters is None or self._split_counters.device != device:
            self._split_counters = torch.zeros(
                _MAX_SPLIT_COUNTERS, dtype=torch.int32, device=device
            )
        return self._split_counters

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNSCALED,
    ) -> None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales.k, kv_scales.v)

    def write_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNSCALED,
        qk_norm: QKNorm | None = None,
        pdl: bool = False,
    ) -> None:
        """One launch: the norm and rotation fused into the KV write."""
        rotate_and_write_kv(
            q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping,
            kv_scales.k, kv_scales.v,
            **_norm_arguments(qk_norm),
            pdl=pdl,
        )  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: KVScales = UNSCALED,
        pdl: bool = False,
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(q)
        assert out.shape == q.shape and out.dtype == q.dtype, "out must be like q"
        num_decodes = meta.num_decode_seqs
        if num_decodes > 0:
            # Decode sequences come first with one row each, so their rows are 0..num_decodes-1.
            paged_decode(
                q[:num_decodes],
                k_cache,
                v_cache,
                meta.block_tables[:num_decodes],
                meta.seq_lens[:num_decodes],
                scale,
                out=out[:num_decodes],
                k_scale=kv_scales.k,
                v_scale=kv_scales.v,
                pdl=pdl,
                **self._decode_options(num_decodes, k_cache, meta.max_seq_len),
            )
        if num_decodes < meta.num_seqs:
            paged_prefill(
                q,
                k_cache,
                v_cache,
                meta.block_tables[num_decodes:],
                meta.seq_lens[num_decodes:],
                meta.query_start_loc[num_decodes:],
                meta.max_query_len,
                scale,
                out=out,
                k_scale=kv_scales.k,
                v_scale=kv_scales.v,
            )
        return out

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTables,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: KVScales = UNSCALED,
        qk_norm: QKNorm | None = None,
        pdl: bool = False,
    ) -> torch.Tensor:
        """A step of at most `ONE_LAUNCH_MAX_SEQS` decodes alone norms, rotates, writes and
        attends in one launch (`rotary_decode`; q is not rotated in place); any other step
        writes, then attends."""
        one_launch = meta.is_decode_only and q.shape[0] == meta.num_seqs
        if not one_launch or meta.num_seqs > ONE_LAUNCH_MAX_SEQS:
            return super().forward_rotary(
                q, k, v, positions, rotary, k_cache, v_cache, meta, scale, out, kv_scales,
                qk_norm, pdl,
            )  # fmt: skip
        return rotary_decode(
            q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping,
            meta.block_tables, meta.seq_lens, scale,
            out=out,
            k_scale=kv_scales.k,
            v_scale=kv_scales.v,
            **_norm_arguments(qk_norm),
            pdl=pdl,
            **self._decode_options(meta.num_seqs, k_cache, meta.max_seq_len),
        )  # fmt: skip

    def _decode_options(
        self, num_decodes: int, k_cache: torch.Tensor, max_seq_len: int
    ) -> dict[str, Any]:
        """The decode launch's splits and tiling for this batch and longest context."""
        num_splits = choose_num_splits(
            num_decodes, int(k_cache.shape[2]), max_seq_len, self.num_sms
        )
        is_fp8 = k_cache.dtype == FP8_CACHE_DTYPE
        return {
            "num_splits": num_splits,
            "split_counters": self._counters(k_cache.device) if num_splits > 1 else None,
            # FP8 tiles spend their time widening to fp16, not loading: where the sequences alone
            # fill the GPU (one split), two warps per program keep more programs resident; where
            # they do not (the launch is split to fill it), four warps finish each split sooner (a
            # lone request 0.89 -> 0.74 ms a token on the 0.6B). Five stages double-buffer the tiles
            # so the next one loads while this one widens (docs/benchmarks-archive.md,
            # "double-buffered FP8 decode tiles" and "whole-row GEMV tiles")
            "num_warps": 2 if is_fp8 and num_splits == 1 else 4,
            "num_stages": 5 if is_fp8 else 3,
        }


def _norm_arguments(qk_norm: QKNorm | None) -> dict[str, Any]:
    """The kernels' q/k norm arguments (none without the norm)."""
    if qk_norm is None:
        return {}
    return {
        "q_norm_weight": qk_norm.q_weight,
        "k_norm_weight": qk_norm.k_weight,
        "norm_eps": qk_norm.eps,
    }
