"""The decode split rule (`decode_core.decode_program` with `paged_decode.SplitRule`), exactly: how
many splits a sequence uses and where each starts, at the engine's tile of 64 tokens."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pagekeeper_engine.kernels.decode_core import decode_program
from pagekeeper_engine.kernels.paged_decode import SHORT_SPLITS, SPLIT_RULE, SplitRule

BLOCK_N = 64  # `paged_decode`'s and `rotary_decode`'s default tile


@triton.jit
def _ranges_kernel(
    seq_lens_ptr,
    out_ptr,  # (B, num_splits, 3) int32: live, start, end
    num_splits,
    short_split_tokens,
    long_split_tokens,
    BLOCK_N: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    SHORT_SPLITS: tl.constexpr,
):
    # A decode grid of one KV head: what each split program of each sequence would cover.
    seq, _, split, _, live, start, end = decode_program(
        seq_lens_ptr, num_splits, short_split_tokens, long_split_tokens, BLOCK_N, FUSED_REDUCE,
        SHORT_SPLITS,
    )  # fmt: skip
    row = out_ptr + (seq * num_splits + split) * 3
    tl.store(row, live)
    tl.store(row + 1, start)
    tl.store(row + 2, end)


def _ranges(
    seq_lens: list[int], num_splits: int, rule: SplitRule, device: torch.device, fused: bool = True
) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each sequence's live splits and the (start, end) of those that hold tokens."""
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full((len(seq_lens), num_splits, 3), -1, dtype=torch.int32, device=device)
    _ranges_kernel[(1, len(seq_lens), num_splits)](
        lens, out, num_splits, rule.short_tokens, rule.long_tokens,
        BLOCK_N=BLOCK_N, FUSED_REDUCE=fused, SHORT_SPLITS=SHORT_SPLITS,
    )  # fmt: skip
    found = []
    for row in out.cpu().tolist():
        live = row[0][0]
        assert all(r[0] == live for r in row), "every split of a sequence agrees on live"
        found.append((live, [(s, e) for _, s, e in row if s < e]))
    return found


@pytest.mark.parametrize(
    ("seq_len", "num_splits", "live", "split_tokens"),
    [
        (1, 16, 1, 64),  # one token: one split
        (128, 16, 2, 64),  # the latency benchmark's first step
        (300, 16, 5, 64),  # short splits: 5 of 64 where 128-token splits gave 3
        (512, 16, 8, 64),  # the last context of short splits (SHORT_SPLITS of 64)
        (513, 16, 5, 128),  # from there, 128-token splits
        (1700, 16, 14, 128),  # a launch of 16 at --max-model-len 2048: 14 used
        (2000, 16, 16, 128),
        (1500, 32, 12, 128),  # a launch of 32 (a longer model length): still 128 a split
        (4000, 32, 32, 128),  # the launch's own share once it exceeds 128
        (5000, 32, 27, 192),  # 27 of 192 hold its tokens: no empty split is live
    ],
)
def test_the_engines_split_rule(
    seq_len: int,
    num_splits: int,
    live: int,
    split_tokens: int,
    device: torch.device,
) -> None:
    ((found_live, ranges),) = _ranges([seq_len], num_splits, SPLIT_RULE, device)
    assert found_live == live and len(ranges) == live  # no live split is empty
    assert ranges == [
        (start, min(start + split_tokens, seq_len)) for start in range(0, seq_len, split_tokens)
    ]


def test_without_the_fused_reduce_every_split_of_the_launch_is_live(device: torch.device) -> None:
    # The reduce kernel combines every split: each takes an even share in whole tiles.
    ((live, ranges),) = _ranges([300], 16, SPLIT_RULE, device, fused=False)
    assert live == 16 and ranges == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]


def test_a_split_rule_keeps_its_lengths_in_order() -> None:
    with pytest.raises(AssertionError, match="out of order"):
        SplitRule(short_tokens=256, long_tokens=128)
