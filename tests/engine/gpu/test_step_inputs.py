"""The packing of a step into the builder's one buffer, including a decode step padded to a
CUDA-graph batch. Pure host arithmetic: it runs on the CPU too, so CI checks the graph layout."""

from __future__ import annotations

import pytest
import torch

from pagekeeper_engine.runner.cuda_graphs import graph_batch_sizes
from pagekeeper_engine.runner.step_inputs import StepInputBuilder
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
    step = builder().build(seqs, pad_to=4)
    assert step.graph_batch == 4
    assert step.input_ids.tolist() == [11, 12, 13, 0]
    assert step.positions.tolist() == [9, 0, 16, 0]
    # The padding row stores no KV (-1) and attends to one token of block 0.
    assert step.meta.slot_mapping.tolist() == [57, 24, 40, -1]
    assert step.meta.seq_lens.tolist() == [10, 1, 17, 1]
    assert step.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # Full width (40 tokens / 8 = 5 columns) whatever the step's own longest table.
    assert step.meta.block_tables.tolist() == [
        [4, 7, 0, 0, 0],
        [3, 0, 0, 0, 0],
        [1, 2, 5, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    assert step.meta.num_decode_seqs == 4 and step.meta.max_query_len == 1
    assert step.sample_indices.tolist() == [0, 1, 2] and step.sampled_seqs == [0, 1, 2]


def test_mixed_step_is_packed_exactly() -> None:
    seqs = [
        seq("d", [50], 9, [4, 7]),
        seq("p", [1, 2, 3, 4, 5, 6], 6, [2, 0, 9], needs_sample=False),
        seq("q", [7, 8, 9], 0, [5]),
    ]
    step = builder().build(seqs)
    assert step.graph_batch is None
    assert step.input_ids.tolist() == [50, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert step.positions.tolist() == [9, 6, 7, 8, 9, 10, 11, 0, 1, 2]
    assert step.meta.slot_mapping.tolist() == [57, 22, 23, 0, 1, 2, 3, 40, 41, 42]
    assert step.meta.query_start_loc.tolist() == [0, 1, 7, 10]
    assert step.meta.block_tables.tolist() == [[4, 7, 0], [2, 0, 9], [5, 0, 0]]
    assert (step.meta.max_query_len, step.meta.max_seq_len, step.meta.num_decode_seqs) == (6, 12, 1)
    assert step.sample_indices.tolist() == [0, 9] and step.sampled_seqs == [0, 2]
    assert [t.dtype for t in (step.input_ids, step.meta.seq_lens)] == [torch.int64, torch.int32]


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
