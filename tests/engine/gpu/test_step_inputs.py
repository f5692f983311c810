"""The packing of a step into the builder's one buffer, including a decode step padded to a
CUDA-graph batch and a mixed step padded to a piecewise graph's rows, and another rank's
builder unpacking the same inputs from the bytes rank 0 sends. Pure host arithmetic: it
runs on the CPU too, so CI checks the graph layouts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.executor.protocol import step_decoder, step_encoder
from pagekeeper_engine.runner.cuda_graphs import graph_batch_sizes
from pagekeeper_engine.runner.follower_step import follower_step
from pagekeeper_engine.runner.piecewise_graphs import piecewise_token_sizes
from pagekeeper_engine.runner.step_inputs import (
    GraphPadding,
    PackedInputs,
    StepInputBuilder,
    StepInputs,
)
from pagekeeper_engine.runner.step_layout import layout, longest_decodes_first
from tests.engine.checkpoints import seq


def builder(max_num_seqs: int = 8) -> StepInputBuilder:
    return StepInputBuilder(
        torch.device("cpu"),
        block_size=8,
        max_model_len=40,
        max_num_tokens=64,
        max_num_seqs=max_num_seqs,
    )


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_decode_step_padded_to_a_graph_batch() -> None:
    seqs = [seq("a", [11], 9, [4, 7]), seq("b", [12], 0, [3]), seq("c", [13], 16, [1, 2, 5])]
    step = builder().build(seqs, GraphPadding(4, decode=True))
    assert step.padding == GraphPadding(4, decode=True)
    # The decodes' rows go longest context first: c, a, b.
    assert step.input_ids.tolist() == [13, 11, 12, 0]
    assert step.positions.tolist() == [16, 9, 0, 0]
    # The padding row stores no KV (-1) and attends to one token of block 0.
    assert step.meta.slot_mapping.tolist() == [40, 57, 24, -1]
    assert step.meta.seq_lens.tolist() == [17, 10, 1, 1]
    assert step.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # Full width (40 tokens / 8 = 5 columns) whatever the step's own longest table.
    assert step.meta.block_tables.tolist() == [
        [1, 2, 5, 0, 0],
        [4, 7, 0, 0, 0],
        [3, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    assert step.meta.num_decode_seqs == 4 and step.meta.max_query_len == 1
    # Each sampled row names its sequence as the caller listed them.
    assert step.sample_indices.tolist() == [0, 1, 2] and step.sampled_seqs == [2, 0, 1]
    assert step.samples_leading_rows  # the runner slices rows 0..2 instead of gathering them


@pytest.mark.parametrize(
    ("num_tokens", "starts", "order"),
    [
        ([1, 1, 1], [9, 0, 16], [2, 0, 1]),
        ([1, 1, 1], [16, 9, 9], None),  # already longest first (ties as they came)
        ([1, 1, 1, 1], [3, 7, 3, 7], [1, 3, 0, 2]),  # stable among equal contexts
        ([1, 1, 6, 1], [2, 5, 0, 9], [1, 0, 2, 3]),  # the prefill and what follows keep place
        ([1], [4], None),
        ([6, 1, 1], [0, 2, 5], None),  # no leading decodes
        ([], [], None),
    ],
)
def test_longest_decodes_first(
    num_tokens: list[int], starts: list[int], order: list[int] | None
) -> None:
    found = longest_decodes_first(np.array(num_tokens, np.int64), np.array(starts, np.int64))
    assert (None if found is None else found.tolist()) == order


def test_a_mixed_step_orders_its_decodes_alone() -> None:
    seqs = [
        seq("d1", [50], 3, [4]),
        seq("d2", [51], 9, [4, 7]),
        seq("p", [1, 2, 3], 0, [5]),
    ]
    step = builder().build(seqs)
    assert step.input_ids.tolist() == [51, 50, 1, 2, 3]
    assert step.meta.seq_lens.tolist() == [10, 4, 3] and step.meta.num_decode_seqs == 2
    assert step.sample_indices.tolist() == [0, 1, 4] and step.sampled_seqs == [1, 0, 2]


def test_mixed_step_is_packed_exactly() -> None:
    seqs = [
        seq("d", [50], 9, [4, 7]),
        seq("p", [1, 2, 3, 4, 5, 6], 6, [2, 0, 9], needs_sample=False),
        seq("q", [7, 8, 9], 0, [5]),
    ]
    step = builder().build(seqs)
    assert step.padding is None
    assert step.input_ids.tolist() == [50, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert step.positions.tolist() == [9, 6, 7, 8, 9, 10, 11, 0, 1, 2]
    assert step.meta.slot_mapping.tolist() == [57, 22, 23, 0, 1, 2, 3, 40, 41, 42]
    assert step.meta.query_start_loc.tolist() == [0, 1, 7, 10]
    assert step.meta.block_tables.tolist() == [[4, 7, 0], [2, 0, 9], [5, 0, 0]]
    assert (step.meta.max_query_len, step.meta.max_seq_len, step.meta.num_decode_seqs) == (6, 12, 1)
    assert step.sample_indices.tolist() == [0, 9] and step.sampled_seqs == [0, 2]
    assert not step.samples_leading_rows
    assert [t.dtype for t in (step.input_ids, step.meta.seq_lens)] == [torch.int64, torch.int32]


def test_placeholder_decodes_lead_the_rows() -> None:
    """A step's placeholder decodes are its leading rows (their gather writes them directly);
    a step whose placeholders sit elsewhere says so. An unpadded step of decodes alone packs
    as a mixed step does."""
    prev = {"a": 1, "b": 0}
    decodes = [
        seq("a", [PLACEHOLDER_TOKEN_ID], 9, [4, 7]),
        seq("b", [PLACEHOLDER_TOKEN_ID], 3, [2]),
    ]
    step = builder().build(decodes, previous_rows=prev)
    assert step.placeholders_lead
    assert step.placeholder_rows is not None and step.placeholder_sources is not None
    assert step.placeholder_rows.tolist() == [0, 1] and step.placeholder_sources.tolist() == [1, 0]
    assert step.positions.tolist() == [9, 3] and step.meta.seq_lens.tolist() == [10, 4]
    assert step.meta.slot_mapping.tolist() == [57, 19]
    assert step.meta.query_start_loc.tolist() == [0, 1, 2]
    assert step.sample_indices.tolist() == [0, 1] and step.samples_leading_rows
    mixed = [decodes[0], seq("p", [1, 2], 0, [5]), seq("b", [PLACEHOLDER_TOKEN_ID], 3, [2])]
    step = builder().build(mixed, previous_rows=prev)
    assert step.placeholder_rows is not None and step.placeholder_rows.tolist() == [0, 3]
    assert not step.placeholders_lead
    assert not builder().build([seq("p", [1, 2], 0, [5])]).placeholders_lead


def test_piecewise_token_sizes() -> None:
    assert piecewise_token_sizes(8) == []  # below the smallest size: every mixed step eager
    assert piecewise_token_sizes(100) == [16, 32, 64, 100]
    assert piecewise_token_sizes(1024) == [16, 32, 64, 128, 256, 512, *range(576, 1025, 64)]
    sizes = piecewise_token_sizes(8192)
    assert sizes[-9:] == list(range(4096, 8193, 512))
    assert len(sizes) == 5 + 1 + 8 * 4  # 16..256, 512, eight an octave to 8,192
    # Above 512 rows a step pads by at most an eighth of its rows.
    assert all(b / a <= 1.125 for a, b in itertools.pairwise(sizes[5:]))
    assert piecewise_token_sizes(65536)[-1] == 8192  # capped: larger steps run eagerly


def test_mixed_step_padded_to_a_piecewise_graph() -> None:
    seqs = [seq("d", [50], 9, [4, 7]), seq("q", [7, 8, 9], 0, [5])]
    step = builder().build(seqs, GraphPadding(8, decode=False))
    assert step.padding == GraphPadding(8, decode=False)
    # Padding rows embed token 0 at position 0 and store no KV.
    assert step.input_ids.tolist() == [50, 7, 8, 9, 0, 0, 0, 0]
    assert step.positions.tolist() == [9, 0, 1, 2, 0, 0, 0, 0]
    assert step.meta.slot_mapping.tolist() == [57, 40, 41, 42, -1, -1, -1, -1]
    # The attention, run eagerly, sees the step's own sequences: no padding sequence.
    assert step.meta.query_start_loc.tolist() == [0, 1, 4]
    assert step.meta.seq_lens.tolist() == [10, 3]
    assert step.meta.block_tables.tolist() == [[4, 7], [5, 0]]
    assert (step.meta.num_decode_seqs, step.meta.max_query_len) == (1, 3)
    assert step.sample_indices.tolist() == [0, 3]


def test_per_row_fields_sit_where_the_row_count_puts_them() -> None:
    # A piecewise graph reads input ids, positions and slots at the addresses it was captured
    # with: their offsets depend on the padded row count alone, not on the sequences.
    captured = layout(num_rows=64, num_seqs=0, width=0, num_sampled=0)
    for num_seqs, width, sampled, placeholders in [(1, 1, 1, 0), (8, 5, 8, 8), (3, 2, 0, 1)]:
        offsets = layout(64, num_seqs, width, sampled, placeholders)
        for field in ("input_ids", "positions", "slot_mapping"):
            assert offsets[field] == captured[field]


def test_a_step_beyond_the_buffer_gets_its_own() -> None:
    # 70 prompt tokens over two sequences: more rows than max_num_tokens (64) allows for.
    seqs = [
        seq("a", list(range(35)), 0, [1, 2, 3, 4, 5]),
        seq("b", list(range(35)), 0, [6, 7, 8, 9, 10]),
    ]
    step = builder().build(seqs)
    assert step.positions.tolist() == list(range(35)) * 2
    assert step.meta.slot_mapping[35:].tolist() == list(range(48, 83))


def test_steps_do_not_share_tensors_on_the_cpu() -> None:
    packer = builder()
    first = packer.build([seq("a", [5], 3, [1])])
    packer.build([seq("b", [6], 4, [2])])
    assert first.input_ids.tolist() == [5] and first.meta.slot_mapping.tolist() == [11]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_steps_of_one_shape_reuse_their_device_views() -> None:
    packer = StepInputBuilder(
        torch.device("cuda"), block_size=8, max_model_len=40, max_num_tokens=64, max_num_seqs=8
    )
    pad = GraphPadding(2, decode=True)
    first = packer.build([seq("b", [6], 9, [2, 4]), seq("a", [5], 3, [1])], pad)
    second = packer.build([seq("b", [8], 10, [2, 4]), seq("a", [7], 4, [1])], pad)
    # The same views of the one buffer, holding the newer step's values.
    assert (
        second.input_ids is first.input_ids and second.meta.block_tables is first.meta.block_tables
    )
    assert second.input_ids.tolist() == [8, 7] and second.meta.slot_mapping.tolist() == [34, 12]
    assert second.meta.block_tables[:, :2].tolist() == [[2, 4], [1, 0]]
    other = packer.build([seq("a", [9], 5, [1])], GraphPadding(4, decode=True))
    assert other.input_ids is not first.input_ids and other.input_ids.tolist() == [9, 0, 0, 0]
    # A bounded number of shapes is kept: many eager shapes do not grow it.
    for rows in range(1, 80):
        packer.build([seq("c", list(range(rows % 30 + 1)), 0, [1, 2, 3, 4])])
    assert len(packer._views) <= 64


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (seq("x", [], 0, [1]), "x: 0 tokens"),
        (seq("y", [1, 2], 39, [1, 2, 3, 4, 5]), "y: 2 tokens from 39"),
        (seq("z", [1, 2, 3], 6, [1]), "z: 3 tokens from 6 with 1 blocks"),
    ],
)
def test_rejects_impossible_sequences(bad: object, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        builder().build([bad])  # type: ignore[list-item]


def _same_inputs(a: StepInputs, b: StepInputs) -> None:
    for name in ("input_ids", "positions", "sample_indices"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert getattr(a.meta, name).tolist() == getattr(b.meta, name).tolist(), name
    assert (a.meta.max_query_len, a.meta.max_seq_len, a.meta.num_decode_seqs) == (
        b.meta.max_query_len,
        b.meta.max_seq_len,
        b.meta.num_decode_seqs,
    )
    assert (a.sampled_seqs, a.samples_leading_rows, a.padding) == (
        b.sampled_seqs,
        b.samples_leading_rows,
        b.padding,
    )
    for name in ("placeholder_rows", "placeholder_sources"):
        left, right = getattr(a, name), getattr(b, name)
        assert (left is None) == (right is None), name
        if left is not None and right is not None:
            assert left.tolist() == right.tolist(), name


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
def test_another_rank_unpacks_the_same_inputs_from_the_wire(device: str) -> None:
    """Rank 0 packs a mixed step (a placeholder decode, a prefill chunk that samples nothing)
    and a padded decode step; another builder rebuilds each from the bytes and header that
    cross the workers' MessagePack, and refuses bytes that do not match their header."""
    make = lambda: StepInputBuilder(  # noqa: E731
        torch.device(device), block_size=8, max_model_len=40, max_num_tokens=64, max_num_seqs=8
    )
    rank0, rank1 = make(), make()
    mixed = [
        seq("a", [PLACEHOLDER_TOKEN_ID], 9, [4, 7]),
        seq("b", list(range(20, 26)), 0, [3], needs_sample=False),
    ]
    padded = ([seq("a", [11], 10, [4, 7]), seq("c", [13], 16, [1, 2, 5])], GraphPadding(4, True))
    for seqs, padding in ((mixed, None), padded):
        sent = rank0.build(seqs, padding, {"a": 1}, keep_packed=True)
        assert sent.packed is not None
        wire = step_encoder().encode(follower_step(SchedulerOutput(seqs, 0), sent))
        arrived = step_decoder().decode(wire)
        assert arrived is not None and arrived.inputs is not None
        _same_inputs(sent, rank1.unpack(arrived.inputs))
    with pytest.raises(AssertionError, match="header"):
        rank1.unpack(PackedInputs(arrived.inputs.header, arrived.inputs.data[:-8]))
    assert rank0.build(mixed, None, {"a": 1}).packed is None  # one rank alone keeps no bytes
