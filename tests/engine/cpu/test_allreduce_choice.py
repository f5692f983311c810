"""The all-reduce's paths: the thresholds chosen from the ranks' timings, the sizes timed, and
the routing of `all_reduce_` between the one-shot path's two ways and NCCL (with stand-ins)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from pagekeeper_engine.config import parse_args
from pagekeeper_engine.distributed.allreduce_choice import (
    AllReduceChoice,
    AllReduceTiming,
    OneShotWay,
    choose,
    combine_rank_timings,
    timed_rows,
)
from pagekeeper_engine.distributed.group import TensorParallelGroup, choose_all_reduce
from pagekeeper_engine.distributed.oneshot import (
    DEFAULT_CAPACITY_BYTES,
    DISABLE_MULTICAST,
    OneShotAllReduce,
    capacity_bytes,
)
from pagekeeper_engine.kernels.peer_reduce import PeerBuffers

ROW = 4096 * 2  # bytes of one bf16 row of an 8B model
INF = math.inf


def timings(*rows: tuple[float, float, float]) -> list[AllReduceTiming]:
    """(nccl_us, push_us, pull_us) at 1, 2, 4, ... rows."""
    return [AllReduceTiming(ROW << i, *row) for i, row in enumerate(rows)]


def maxima(measured: list[AllReduceTiming]) -> tuple[int, int]:
    choice = choose(measured)
    return choice.one_shot_max_bytes, choice.push_max_bytes


def test_one_shot_always_faster_takes_the_largest_size() -> None:
    assert maxima(timings((15.5, 4.0, 5.0), (10.4, 4.2, 5.0), (12.7, 5.0, 6.0))) == (4 * ROW,) * 2


def test_one_shot_never_faster_takes_none() -> None:
    measured = timings((10.0, 11.0, 12.0), (10.4, 12.0, 13.0), (12.7, 20.0, 21.0))
    assert maxima(measured) == (0, 0)


def test_a_tie_keeps_nccl_and_a_tie_between_the_ways_pulls() -> None:
    assert maxima(timings((10.0, 10.0, 10.0), (10.4, 5.0, 5.0))) == (0, 0)
    assert maxima(timings((10.0, 5.0, 5.0), (10.4, 4.0, 5.0))) == (2 * ROW, 0)


def test_push_for_the_small_sizes_pull_for_the_middle_and_nccl_above() -> None:
    # 2 x H200 figures (docs/benchmarks-archive.md, "small all-reduces pushed"), rounded: push wins
    # to 1 MiB, pull to 8 MiB, then NCCL
    measured = [
        AllReduceTiming(2**20, 16.8, 9.7, 10.8),
        AllReduceTiming(2 * 2**20, 30.1, 14.2, 14.0),
        AllReduceTiming(8 * 2**20, 54.1, 44.1, 33.3),
        AllReduceTiming(16 * 2**20, 90.4, INF, 60.5),  # past the receiving regions
        AllReduceTiming(128 * 2**20, 594.9, INF, 412.0),
    ]
    choice = choose(measured)
    assert (choice.one_shot_max_bytes, choice.push_max_bytes) == (128 * 2**20, 2**20)
    assert [choice.way(n) for n in (1, 2**20, 2**20 + 1, 128 * 2**20, 128 * 2**20 + 1)] == [
        "push",
        "push",
        "pull",
        "pull",
        None,
    ]


def test_faster_at_small_sizes_takes_the_last_size_of_the_leading_run() -> None:
    measured = timings(
        (15.5, 4.0, 5.0), (10.4, 4.5, 5.0), (10.9, 6.0, 7.0), (12.7, 13.0, 14.0), (28.6, 40.0, 41.0)
    )
    assert maxima(measured) == (4 * ROW, 4 * ROW)


def test_a_single_win_after_a_loss_is_ignored() -> None:
    measured = timings((15.5, 4.0, 5.0), (10.4, 11.0, 12.0), (12.7, 12.0, 13.0), (28.6, 40.0, 41.0))
    assert maxima(measured) == (ROW, ROW)
    # and a push win after a pull win
    assert maxima(timings((15.5, 4.0, 5.0), (10.4, 6.0, 5.0), (12.7, 5.0, 6.0))) == (4 * ROW, ROW)


def test_the_order_of_the_timings_does_not_matter() -> None:
    measured = timings((15.5, 4.0, 5.0), (10.4, 4.5, 4.0), (12.7, 13.0, 14.0))
    assert maxima(list(reversed(measured))) == (2 * ROW, ROW)


def test_no_timings_take_none() -> None:
    assert maxima([]) == (0, 0)


def test_ranks_combine_at_the_slowest_rank_of_each_way() -> None:
    rank0 = timings((10.0, 4.0, 5.0), (11.0, 9.0, 8.0))
    rank1 = timings((12.0, 3.0, 6.0), (10.0, 13.0, 7.0))
    assert combine_rank_timings([rank0, rank1]) == timings((12.0, 4.0, 6.0), (11.0, 13.0, 8.0))
    # rank 0 alone would push one row and pull two; the slowest ranks' figures pull both
    assert maxima(rank0) == (2 * ROW, ROW)
    assert maxima(combine_rank_timings([rank0, rank1])) == (2 * ROW, ROW)
    assert maxima(combine_rank_timings([rank1, rank0])) == (2 * ROW, ROW)


def test_the_choice_names_every_way_and_the_sizes_a_way_cannot_take() -> None:
    text = choose(timings((15.5, 4.0, 5.0), (10.4, INF, 5.0))).describe()
    assert text == (
        f"one-shot up to {2 * ROW} bytes, pushed up to {ROW}, NCCL above (with the norm: "
        f"{ROW} B: 4.0 us push / 5.0 us pull / 15.5 us NCCL, "
        f"{2 * ROW} B: - push / 5.0 us pull / 10.4 us NCCL)"
    )


def test_ranks_that_timed_different_sizes_are_refused() -> None:
    with pytest.raises(AssertionError, match="different sizes"):
        combine_rank_timings([timings((1.0, 1.0, 1.0)), timings((1.0, 1.0, 1.0), (2.0, 2.0, 2.0))])


def test_timed_rows_double_up_to_what_the_buffer_holds() -> None:
    assert timed_rows(8 * 2**20, 4096, 2) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert timed_rows(100 * ROW, 4096, 2) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert timed_rows(ROW, 4096, 2) == [1]
    assert timed_rows(ROW - 1, 4096, 2) == []


def test_two_ranks_size_the_buffer_for_a_whole_step_and_more_ranks_for_decode_steps() -> None:
    assert capacity_bytes(2, 8192, 4096, 2) == 8192 * ROW  # the prefill chunks may go one-shot
    assert capacity_bytes(2, 256, 4096, 2) == DEFAULT_CAPACITY_BYTES  # never below the default
    assert capacity_bytes(4, 8192, 8192, 2) == DEFAULT_CAPACITY_BYTES
    assert capacity_bytes(8, 8192, 8192, 2) == DEFAULT_CAPACITY_BYTES


def test_one_shot_fits_only_contiguous_tensors_of_its_dtype_and_device_within_capacity() -> None:
    memory = torch.empty(16, dtype=torch.bfloat16)  # a staging region of 8, receiving ones of 4
    one_shot = OneShotAllReduce(memory, torch.zeros(2, dtype=torch.int32), 8, 4, "0")
    assert one_shot.fits(torch.empty(2, 4, dtype=torch.bfloat16), "pull")
    assert not one_shot.fits(torch.empty(2, 4, dtype=torch.bfloat16), "push")  # past a region
    assert one_shot.fits(torch.empty(1, 4, dtype=torch.bfloat16), "push")
    for way in ("push", "pull"):
        # larger than the buffer
        assert not one_shot.fits(torch.empty(3, 3, dtype=torch.bfloat16), way)
        assert not one_shot.fits(torch.empty(1, 4, dtype=torch.float32), way)
        assert not one_shot.fits(torch.empty(2, 2, dtype=torch.bfloat16).t(), way)
        assert not one_shot.fits(torch.empty(1, 4, dtype=torch.bfloat16, device="meta"), way)


class RecordingOneShot(OneShotAllReduce):
    def __init__(self) -> None:
        # A staging region of 64 values and receiving regions of 32.
        counts = torch.zeros(2, dtype=torch.int32)
        super().__init__(torch.empty(64 + 2 * 32, dtype=torch.bfloat16), counts, 64, 32, "0")
        self.calls: list[tuple[int, OneShotWay]] = []
        no_addresses = torch.zeros(2, dtype=torch.int64)  # never launched: nothing mapped
        self.peers = PeerBuffers(self.memory, no_addresses, no_addresses, counts, 0, 2, 64, 32, 1)

    def all_reduce_(self, x: torch.Tensor, way: OneShotWay) -> None:
        self.calls.append((x.numel(), way))


def test_all_reduce_goes_one_shot_up_to_the_threshold_and_to_nccl_above(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = TensorParallelGroup(rank=0, size=2)
    one_shot = RecordingOneShot()
    nccl: list[int] = []
    monkeypatch.setattr(group, "_nccl_all_reduce_", lambda x: nccl.append(x.numel()))
    group.one_shot = one_shot
    group.one_shot_choice = AllReduceChoice(32 * 2, push_max_bytes=16 * 2)  # in bf16 values
    group.all_reduce_(torch.empty(2, 8, dtype=torch.bfloat16))  # at the push threshold
    group.all_reduce_(torch.empty(3, 8, dtype=torch.bfloat16))  # above it: pulled
    group.all_reduce_(torch.empty(4, 8, dtype=torch.bfloat16))  # at the one-shot threshold
    group.all_reduce_(torch.empty(5, 8, dtype=torch.bfloat16))  # above it
    group.all_reduce_(torch.empty(2, 4, dtype=torch.float32))  # the buffer's dtype is bf16
    with group.local_only():
        group.all_reduce_(torch.empty(1, 8, dtype=torch.bfloat16))  # no collective at all
    assert one_shot.calls == [(16, "push"), (24, "pull"), (32, "pull")]
    assert nccl == [40, 8]


def test_partial_rows_are_the_buffer_exactly_where_all_reduce_goes_one_shot() -> None:
    group = TensorParallelGroup(rank=0, size=2)
    assert group.partial_rows(2, 8, torch.bfloat16) is None  # no one-shot path set up
    one_shot = RecordingOneShot()
    group.one_shot = one_shot
    group.one_shot_choice = AllReduceChoice(32 * 2, push_max_bytes=16 * 2)  # in bf16 values
    staged = group.partial_rows(2, 8, torch.bfloat16)  # at the push threshold
    assert staged is not None and (staged.rows.shape, staged.way) == ((2, 8), "push")
    assert staged.rows.data_ptr() == one_shot.buffer.data_ptr()
    pulled = group.partial_rows(4, 8, torch.bfloat16)  # at the one-shot threshold
    assert pulled is not None and (pulled.rows.shape, pulled.way) == ((4, 8), "pull")
    assert pulled.rows.data_ptr() == one_shot.buffer.data_ptr()
    assert group.partial_rows(5, 8, torch.bfloat16) is None  # above it: NCCL
    assert group.partial_rows(2, 4, torch.float32) is None  # the buffer holds bf16
    with group.local_only():
        assert group.partial_rows(1, 8, torch.bfloat16) is None  # nothing to sum


def test_single_rank_never_touches_symmetric_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_MULTICAST, raising=False)
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", None)  # import fails
    group = TensorParallelGroup()
    choice = group.enable_one_shot(8 * 2**20, 4096, torch.bfloat16)
    assert (choice.one_shot_max_bytes, choice.off_reason) == (0, "a single rank")
    assert group.one_shot is None
    assert DISABLE_MULTICAST not in os.environ
    x = torch.ones(2, 3)
    group.all_reduce_(x)
    assert torch.equal(x, torch.ones(2, 3))


def test_ranks_off_gpus_keep_nccl_without_a_collective() -> None:
    group = TensorParallelGroup(rank=1, size=2)  # never initialized: a gather would fail
    group.device = torch.device("cpu")
    choice = group.enable_one_shot(8 * 2**20, 4096, torch.float32)
    assert (choice.one_shot_max_bytes, choice.off_reason) == (0, "not on GPUs")
    assert choice.describe() == "NCCL for every size (not on GPUs)"
    assert group.one_shot is None


def test_the_flag_keeps_nccl_without_timing_or_a_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_args(["/m", "--disable-custom-all-reduce"]).disable_custom_all_reduce
    assert not parse_args(["/m"]).disable_custom_all_reduce
    group = TensorParallelGroup(rank=1, size=2)  # never initialized: a gather would fail
    group.device = torch.device("cuda", 1)  # where the one-shot path would be set up

    def set_up(*_: object) -> None:
        raise AssertionError("enable_one_shot ran under --disable-custom-all-reduce")

    monkeypatch.setattr(group, "enable_one_shot", set_up)
    choice = choose_all_reduce(group, True, 4096, torch.bfloat16, 8192)
    assert choice.describe() == "NCCL for every size (--disable-custom-all-reduce)"
    assert group.one_shot is None and group.one_shot_choice is None
    # At one rank there is nothing to disable: the group's own answer.
    alone = choose_all_reduce(TensorParallelGroup(), True, 4096, torch.bfloat16, 8192)
    assert alone.off_reason == "a single rank"
