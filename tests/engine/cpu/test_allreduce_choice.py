"""The all-reduce's path: the threshold chosen from the ranks' timings, the sizes timed, and the
routing of `all_reduce_` between the one-shot path and NCCL (with stand-ins for both)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from pagekeeper_engine.config import parse_args
from pagekeeper_engine.distributed.group import TensorParallelGroup, choose_all_reduce
from pagekeeper_engine.distributed.oneshot import (
    DEFAULT_CAPACITY_BYTES,
    DISABLE_MULTICAST,
    AllReduceTiming,
    OneShotAllReduce,
    capacity_bytes,
    choose_one_shot_max_bytes,
    combine_rank_timings,
    timed_rows,
)
from pagekeeper_engine.kernels.peer_reduce import PeerBuffers

ROW = 4096 * 2  # bytes of one bf16 row of an 8B model


def timings(*pairs: tuple[float, float]) -> list[AllReduceTiming]:
    """(nccl_us, one_shot_us) at 1, 2, 4, ... rows."""
    return [AllReduceTiming(ROW << i, nccl, one) for i, (nccl, one) in enumerate(pairs)]


def test_one_shot_always_faster_takes_the_largest_size() -> None:
    assert choose_one_shot_max_bytes(timings((15.5, 4.0), (10.4, 4.2), (12.7, 5.0))) == 4 * ROW


def test_one_shot_never_faster_takes_none() -> None:
    assert choose_one_shot_max_bytes(timings((10.0, 11.0), (10.4, 12.0), (12.7, 20.0))) == 0


def test_a_tie_keeps_nccl() -> None:
    assert choose_one_shot_max_bytes(timings((10.0, 10.0), (10.4, 5.0))) == 0


def test_faster_at_small_sizes_takes_the_last_size_of_the_leading_run() -> None:
    measured = timings((15.5, 4.0), (10.4, 4.5), (10.9, 6.0), (12.7, 13.0), (28.6, 40.0))
    assert choose_one_shot_max_bytes(measured) == 4 * ROW


def test_a_single_win_after_a_loss_is_ignored() -> None:
    measured = timings((15.5, 4.0), (10.4, 11.0), (12.7, 12.0), (28.6, 40.0))
    assert choose_one_shot_max_bytes(measured) == ROW


def test_the_order_of_the_timings_does_not_matter() -> None:
    measured = timings((15.5, 4.0), (10.4, 4.5), (12.7, 13.0))
    assert choose_one_shot_max_bytes(list(reversed(measured))) == 2 * ROW


def test_no_timings_take_none() -> None:
    assert choose_one_shot_max_bytes([]) == 0


def test_ranks_combine_at_the_slowest_rank_of_each_path() -> None:
    rank0 = timings((10.0, 4.0), (11.0, 9.0))
    rank1 = timings((12.0, 3.0), (10.0, 13.0))
    assert combine_rank_timings([rank0, rank1]) == timings((12.0, 4.0), (11.0, 13.0))
    # rank 0 alone would keep one-shot at 2 rows; the slowest ranks' figures do not
    assert choose_one_shot_max_bytes(rank0) == 2 * ROW
    assert choose_one_shot_max_bytes(combine_rank_timings([rank0, rank1])) == ROW


def test_ranks_that_timed_different_sizes_are_refused() -> None:
    with pytest.raises(AssertionError, match="different sizes"):
        combine_rank_timings([timings((1.0, 1.0)), timings((1.0, 1.0), (2.0, 2.0))])


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
    one_shot = OneShotAllReduce(torch.empty(8, dtype=torch.bfloat16), "0")
    assert one_shot.fits(torch.empty(2, 4, dtype=torch.bfloat16))
    assert not one_shot.fits(torch.empty(3, 3, dtype=torch.bfloat16))  # larger than the buffer
    assert not one_shot.fits(torch.empty(2, 4, dtype=torch.float32))
    assert not one_shot.fits(torch.empty(4, 2, dtype=torch.bfloat16).t())
    assert not one_shot.fits(torch.empty(2, 4, dtype=torch.bfloat16, device="meta"))


class RecordingOneShot(OneShotAllReduce):
    def __init__(self) -> None:
        super().__init__(torch.empty(64, dtype=torch.bfloat16), "0")
        self.numels: list[int] = []
        no_addresses = torch.zeros(2, dtype=torch.int64)  # never launched: nothing mapped
        self.peers = PeerBuffers(self.buffer, no_addresses, no_addresses, 0, 2, 1)

    def all_reduce_(self, x: torch.Tensor) -> None:
        self.numels.append(x.numel())


def test_all_reduce_goes_one_shot_up_to_the_threshold_and_to_nccl_above(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = TensorParallelGroup(rank=0, size=2)
    one_shot = RecordingOneShot()
    nccl: list[int] = []
    monkeypatch.setattr(group, "_nccl_all_reduce_", lambda x: nccl.append(x.numel()))
    group.one_shot, group.one_shot_max_bytes = one_shot, 16 * 2  # 16 bf16 values
    group.all_reduce_(torch.empty(2, 8, dtype=torch.bfloat16))  # at the threshold
    group.all_reduce_(torch.empty(3, 8, dtype=torch.bfloat16))  # above it
    group.all_reduce_(torch.empty(2, 4, dtype=torch.float32))  # the buffer's dtype is bf16
    with group.local_only():
        group.all_reduce_(torch.empty(1, 8, dtype=torch.bfloat16))  # no collective at all
    assert one_shot.numels == [16]
    assert nccl == [24, 8]


def test_partial_rows_are_the_buffer_exactly_where_all_reduce_goes_one_shot() -> None:
    group = TensorParallelGroup(rank=0, size=2)
    assert group.partial_rows(2, 8, torch.bfloat16) is None  # no one-shot path set up
    one_shot = RecordingOneShot()
    group.one_shot, group.one_shot_max_bytes = one_shot, 16 * 2  # 16 bf16 values
    staged = group.partial_rows(2, 8, torch.bfloat16)  # at the threshold
    assert staged is not None and staged.rows.shape == (2, 8)
    assert staged.rows.data_ptr() == one_shot.buffer.data_ptr()
    assert group.partial_rows(3, 8, torch.bfloat16) is None  # above it: NCCL
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
    assert group.one_shot is None and group.one_shot_max_bytes == 0
    # At one rank there is nothing to disable: the group's own answer.
    alone = choose_all_reduce(TensorParallelGroup(), True, 4096, torch.bfloat16, 8192)
    assert alone.off_reason == "a single rank"
