"""Where each field of a step's packed inputs sits in the builder's one byte buffer
(`step_inputs.py`): the per-row fields first, each 8-aligned, at offsets that depend only on
the step's counts, so a step padded to a captured graph's shape lands where the graph reads it.
"""

from __future__ import annotations

import torch

_ALIGN = 8  # bytes: every field starts 8-aligned, so int64 views of the byte buffer are legal


def field_counts(
    num_rows: int, num_seqs: int, width: int, num_sampled: int, num_placeholders: int
) -> dict[str, tuple[int, torch.dtype]]:
    """Each field's element count and dtype, in buffer order: fields a graph reads first, those
    whose count varies at a fixed graph shape last."""
    return {
        "input_ids": (num_rows, torch.int64),
        "positions": (num_rows, torch.int64),
        "slot_mapping": (num_rows, torch.int64),
        "query_start_loc": (num_seqs + 1, torch.int32),
        "seq_lens": (num_seqs, torch.int32),
        "block_tables": (num_seqs * width, torch.int32),
        "sample_indices": (num_sampled, torch.int64),
        "placeholder_rows": (num_placeholders, torch.int64),
        "placeholder_sources": (num_placeholders, torch.int64),
    }


def layout(
    num_rows: int, num_seqs: int, width: int, num_sampled: int, num_placeholders: int = 0
) -> dict[str, int]:
    """Byte offset of each field, and the total under "end"."""
    offsets, end = {}, 0
    for name, (count, dtype) in field_counts(
        num_rows, num_seqs, width, num_sampled, num_placeholders
    ).items():
        offsets[name] = end
        end += -(-count * dtype.itemsize // _ALIGN) * _ALIGN
    offsets["end"] = end
    return offsets


def typed_views(
    buffer: torch.Tensor, offsets: dict[str, int], shape: tuple[int, int, int, int, int]
) -> dict[str, torch.Tensor]:
    """Typed views of the fields in `buffer` (bytes) at `offsets` (`layout`); the block tables
    (seqs, width)."""
    views = {}
    for name, (count, dtype) in field_counts(*shape).items():
        start = offsets[name]
        views[name] = buffer[start : start + count * dtype.itemsize].view(dtype)
    _, seqs, width, _, _ = shape
    views["block_tables"] = views["block_tables"].view(seqs, width)
    return views
