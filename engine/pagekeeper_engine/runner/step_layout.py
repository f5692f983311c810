"""Where each field of a step's packed inputs sits in the builder's one byte buffer
(`step_inputs.py`): the per-row fields first, each 8-aligned, at offsets that depend only on
the step's counts, so a step padded to a captured graph's shape lands where the graph reads it;
and the order of the step's sequences in its rows (`longest_decodes_first`).
"""

from __future__ import annotations

import numpy as np
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


def longest_decodes_first(num_tokens: np.ndarray, starts: np.ndarray) -> np.ndarray | None:
    """The rows' order of a step's sequences (their token counts and cached tokens, decodes
    first): the leading one-token sequences by their context, longest first (ties as they
    came), the others after them as they came; None where that is the order already.

    The decode kernel hands out a sequence's programs together, in row order
    (`kernels/decode_core.decode_program`): longest first, the last programs to start are
    short, and a batch of mixed lengths ends together (docs/benchmarks-archive.md, "a decode
    launch's last wave")."""
    is_one = num_tokens == 1
    lead = len(num_tokens) if is_one.all() else int(is_one.argmin())
    contexts = starts[:lead]
    if lead < 2 or bool((contexts[:-1] >= contexts[1:]).all()):
        return None
    order = np.arange(len(num_tokens))
    order[:lead] = np.argsort(-contexts, kind="stable")
    return order
