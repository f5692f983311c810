"""A step's input tensors in one static buffer (`StepInputBuilder`).

Every index tensor of a step (input ids, positions, slots, query start offsets, sequence
lengths, block tables, sampled rows) is computed with numpy, written into one pinned host buffer
and moved to the device in a single copy, into a device buffer that is reused every step. Each
field is a typed view at an offset that depends only on the step's (rows, sequences, block-table
width), so a decode step padded to a captured batch size lands at exactly the addresses its CUDA
graph was captured with (`cuda_graphs.py`). The per-row fields (input ids, positions, slots)
come first: any step padded to a captured row count finds them where that row count's piecewise
graphs read them (`piecewise_graphs.py`). Rows whose input token is not known on the host yet
(`PLACEHOLDER_TOKEN_ID`, asynchronous scheduling) are listed with the row of the previous step's
sampled ids that holds it; the runner gathers them on the device.

Under tensor parallelism rank 0 alone builds a step: the other ranks take its packed bytes and
`StepHeader` (`PackedInputs`, `StepInputBuilder.unpack`) and copy them to their own device, so
no rank decodes the scheduler's sequences or repeats the packing.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagekeeper_engine.attention.base import AttentionMetadata
from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.runner.step_layout import layout, longest_decodes_first, typed_views

_MAX_CACHED_SHAPES = 64  # step shapes whose device views are kept


@dataclass(frozen=True)
class GraphPadding:
    """How a step is padded to a captured graph's shape. `rows`: the token rows. A decode graph
    (`decode`) also gives each padding row a sequence of its own and every sequence the full
    block-table width; a piecewise graph pads only the rows (its attention runs eagerly on the
    step's own sequences)."""

    rows: int
    decode: bool


@dataclass(frozen=True)
class StepHeader:
    """What a step's packed bytes hold and mean beside them: their fields' counts (`shape`,
    which fixes the layout), the graph padding, and the metadata that is not a tensor."""

    shape: tuple[int, int, int, int, int]  # (rows, seqs, block-table width, sampled, placeholders)
    padding: GraphPadding | None
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int
    sampled_seqs: list[int]
    samples_leading_rows: bool
    placeholders_lead: bool = False  # the placeholder rows are rows 0..P-1


@dataclass(frozen=True)
class PackedInputs:
    """A step's inputs as bytes: another rank's builder makes the same `StepInputs` of them."""

    header: StepHeader
    data: bytes  # every field at its `step_layout.layout` offset


@dataclass
class StepInputs:
    """The packed tensors of one step, on the runner's device."""

    input_ids: torch.Tensor  # (T,) int64; T includes padding rows of a graph batch
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # (N,) int64: rows of the hidden states to compute logits for
    sampled_seqs: list[int]  # (N,) index into the step's seqs of each sampled row
    # sample_indices is 0..N-1 (every sequence one token and sampled): the rows are a slice
    samples_leading_rows: bool = False
    padding: GraphPadding | None = None  # the captured shape this step was padded to
    # (P,) int64 each: rows of input_ids still to fill, and the rows of the previous step's
    # sampled ids that hold their tokens; None when every input is known
    placeholder_rows: torch.Tensor | None = None
    placeholder_sources: torch.Tensor | None = None
    placeholders_lead: bool = False  # placeholder_rows is 0..P-1 (the decodes of a step)
    packed: PackedInputs | None = None  # with `build(..., keep_packed=True)`


class StepInputBuilder:
    """Packs scheduled sequences into a step's tensors with one host-to-device copy.

    The device buffer is overwritten by the next step's copy (stream-ordered after this step's
    kernels), so a step's tensors are valid until the next `build` on CUDA; on the CPU each step
    gets fresh tensors.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        block_size: int,
        max_model_len: int,
        max_num_tokens: int,
        max_num_seqs: int,
    ):
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_width = -(-max_model_len // block_size)  # block-table columns of a graph step
        max_rows = max(max_num_tokens, max_num_seqs)  # a padded graph step has max_num_seqs
        self.capacity = layout(max_rows, max_num_seqs, self.max_width, max_num_seqs, max_num_seqs)[
            "end"
        ]
        is_cuda = device.type == "cuda"
        self._staging = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=is_cuda)
        self._device_buffer = (
            torch.empty(self.capacity, dtype=torch.uint8, device=device) if is_cuda else None
        )
        self._staging_bytes = self._staging.numpy()
        # the last copy out of staging
        self._staged = torch.cuda.Event() if is_cuda else None  # type: ignore[no-untyped-call]
        # step shape -> views of the device buffer, most recently used last
        self._views: dict[tuple[int, int, int, int, int], dict[str, torch.Tensor]] = {}

    def build(
        self,
        seqs: Sequence[ScheduledSeq],
        padding: GraphPadding | None = None,
        previous_rows: Mapping[str, int] | None = None,
        *,
        keep_packed: bool = False,
    ) -> StepInputs:
        """Pack `seqs` (decodes first), padded for a graph with `padding`: padding rows store
        no KV (slot -1). A decode graph's seqs are all one-token decodes, padded to that many
        sequences at the full block-table width. The decodes' rows go longest context first
        (`step_layout.longest_decodes_first`); `sampled_seqs` indexes `seqs` as given.
        `previous_rows`: request id -> row of the previous step's sampled ids, for the
        placeholder inputs. `keep_packed`: the inputs also keep their bytes, for the other
        ranks (`unpack`)."""
        bs = self.block_size
        num_seqs = len(seqs)
        num_tokens = np.fromiter((s.num_tokens for s in seqs), np.int64, num_seqs)
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, num_seqs)
        order = longest_decodes_first(num_tokens, starts)
        if order is not None:  # from here on, seqs in row order
            seqs = [seqs[i] for i in order.tolist()]
            num_tokens, starts = num_tokens[order], starts[order]
        num_blocks = np.fromiter((len(s.block_ids) for s in seqs), np.int64, num_seqs)
        ends = starts + num_tokens
        self._check(seqs, num_tokens, ends, num_blocks)
        total = int(num_tokens.sum())
        rows, padded_seqs, width = total, num_seqs, int(num_blocks.max(initial=0))
        is_decode_graph = padding is not None and padding.decode
        if padding is not None and padding.decode:
            assert total == num_seqs <= padding.rows, "a decode graph holds one-token decodes"
            rows, padded_seqs, width = padding.rows, padding.rows, self.max_width
        elif padding is not None:
            assert total <= padding.rows, f"{total} rows do not fit a graph of {padding.rows}"
            rows = padding.rows

        one_token_each = total == num_seqs  # a step of decodes alone: row i is sequence i
        # Padding sequences (a decode graph's) have one row each, after the real rows.
        query_start_loc = np.arange(padded_seqs + 1, dtype=np.int32) + (total - num_seqs)
        if not one_token_each:  # otherwise the arange is already the running sum of ones
            query_start_loc[: num_seqs + 1] = 0
            np.cumsum(num_tokens, out=query_start_loc[1 : num_seqs + 1], dtype=np.int32)
        seq_lens = np.ones(padded_seqs, dtype=np.int32)  # padding rows attend to one token
        seq_lens[:num_seqs] = ends
        block_tables = np.zeros((padded_seqs, width), dtype=np.int32)
        has_block = np.arange(width)[None, :] < num_blocks[:, None]  # (num_seqs, width)
        block_tables[:num_seqs][has_block] = np.fromiter(
            itertools.chain.from_iterable(s.block_ids for s in seqs), np.int32, int(has_block.sum())
        )
        positions = np.zeros(rows, dtype=np.int64)
        if one_token_each:
            token_seq = np.arange(num_seqs)
            positions[:total] = starts
        else:
            token_seq = np.repeat(np.arange(num_seqs), num_tokens)  # (total,) row -> its sequence
            positions[:total] = np.arange(total) - query_start_loc[token_seq] + starts[token_seq]
        real_positions = positions[:total]
        input_ids = np.zeros(rows, dtype=np.int64)
        input_ids[:total] = np.fromiter(
            itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64, total
        )
        slot_mapping = np.full(rows, -1, dtype=np.int64)  # -1: a padding row stores no KV
        slot_mapping[:total] = (
            block_tables[token_seq, real_positions // bs].astype(np.int64) * bs
            + real_positions % bs
        )
        placeholder_rows = np.flatnonzero(input_ids[:total] == PLACEHOLDER_TOKEN_ID)
        placeholder_sources = self._placeholder_sources(
            seqs, token_seq[placeholder_rows], previous_rows
        )
        input_ids[placeholder_rows] = 0  # a valid id until the gather overwrites it
        needs_sample = np.fromiter((s.needs_sample for s in seqs), np.bool_, num_seqs)
        sampled_seqs = np.flatnonzero(needs_sample)
        sample_indices = (
            sampled_seqs  # row i is sequence i
            if one_token_each
            else query_start_loc[1 : num_seqs + 1][sampled_seqs].astype(np.int64) - 1
        )

        arrays: dict[str, np.ndarray] = {
            "input_ids": input_ids,
            "positions": positions,
            "slot_mapping": slot_mapping,
            "query_start_loc": query_start_loc,
            "seq_lens": seq_lens,
            "block_tables": block_tables,
            "sample_indices": sample_indices,
            "placeholder_rows": placeholder_rows.astype(np.int64),
            "placeholder_sources": placeholder_sources,
        }
        is_one = num_tokens == 1
        num_decode_seqs = num_seqs if is_one.all() else int(is_one.argmin())
        header = StepHeader(
            shape=(rows, padded_seqs, width, len(sampled_seqs), len(placeholder_rows)),
            padding=padding,
            max_query_len=int(num_tokens.max(initial=1)),
            max_seq_len=int(ends.max(initial=1)),
            num_decode_seqs=padded_seqs if is_decode_graph else num_decode_seqs,
            sampled_seqs=(sampled_seqs if order is None else order[sampled_seqs]).tolist(),
            samples_leading_rows=len(sampled_seqs) == num_seqs == total,
            placeholders_lead=len(placeholder_rows) > 0
            and int(placeholder_rows[-1]) == len(placeholder_rows) - 1,
        )
        offsets = layout(*header.shape)
        host, host_bytes = self._host(offsets["end"])
        for name, array in arrays.items():
            start = offsets[name]
            host_bytes[start : start + array.nbytes].view(array.dtype)[:] = array.ravel()
        packed = None
        if keep_packed:
            packed = PackedInputs(header, host_bytes[: offsets["end"]].tobytes())
        return self._inputs(header, self._upload(host, header.shape, offsets), packed)

    def unpack(self, packed: PackedInputs) -> StepInputs:
        """The inputs another rank's builder packed: the same tensors, on this rank's device."""
        header = packed.header
        offsets = layout(*header.shape)
        assert len(packed.data) == offsets["end"], "bytes and header disagree"
        host, host_bytes = self._host(offsets["end"])
        host_bytes[: len(packed.data)] = np.frombuffer(packed.data, dtype=np.uint8)
        return self._inputs(header, self._upload(host, header.shape, offsets))

    @staticmethod
    def _inputs(
        header: StepHeader, views: dict[str, torch.Tensor], packed: PackedInputs | None = None
    ) -> StepInputs:
        has_placeholders = header.shape[4] > 0
        meta = AttentionMetadata(
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=views["block_tables"],
            max_query_len=header.max_query_len,
            max_seq_len=header.max_seq_len,
            num_decode_seqs=header.num_decode_seqs,
        )
        return StepInputs(
            input_ids=views["input_ids"],
            positions=views["positions"],
            meta=meta,
            sample_indices=views["sample_indices"],
            sampled_seqs=header.sampled_seqs,
            samples_leading_rows=header.samples_leading_rows,
            padding=header.padding,
            placeholder_rows=views["placeholder_rows"] if has_placeholders else None,
            placeholder_sources=views["placeholder_sources"] if has_placeholders else None,
            placeholders_lead=header.placeholders_lead,
            packed=packed,
        )

    @staticmethod
    def _placeholder_sources(
        seqs: Sequence[ScheduledSeq],
        seq_of_row: np.ndarray,
        previous_rows: Mapping[str, int] | None,
    ) -> np.ndarray:
        """Row of the previous step's sampled ids for each placeholder input (its sequence's
        newest token, sampled by that step)."""
        if len(seq_of_row) == 0:
            return np.zeros(0, dtype=np.int64)
        rows = previous_rows or {}
        try:
            return np.fromiter(
                (rows[seqs[i].request_id] for i in seq_of_row.tolist()), np.int64, len(seq_of_row)
            )
        except KeyError as exc:
            raise AssertionError(
                f"{exc.args[0]}: an unknown input token, but the previous step sampled none"
            ) from None

    def _check(
        self,
        seqs: Sequence[ScheduledSeq],
        num_tokens: np.ndarray,
        ends: np.ndarray,
        num_blocks: np.ndarray,
    ) -> None:
        is_bad = (
            (num_tokens <= 0) | (ends > self.max_model_len) | (num_blocks * self.block_size < ends)
        )
        if is_bad.any():
            seq = seqs[int(is_bad.argmax())]
            raise AssertionError(
                f"{seq.request_id}: {seq.num_tokens} tokens from {seq.start_pos} with "
                f"{len(seq.block_ids)} blocks of {self.block_size} (max_model_len "
                f"{self.max_model_len}): empty, too long or a block table too short"
            )

    def _host(self, end: int) -> tuple[torch.Tensor, np.ndarray]:
        """Host memory for a step of `end` bytes, and its bytes: the staging buffer once the
        previous copy has left it, or (a step larger than the sizes the buffer was made for: a
        profiling pass) a buffer of its own."""
        if end > self.capacity:
            host = torch.empty(end, dtype=torch.uint8)
            return host, host.numpy()
        if self._staged is not None:
            self._staged.synchronize()  # the previous copy has left the staging buffer
        return self._staging, self._staging_bytes

    def _upload(
        self, host: torch.Tensor, shape: tuple[int, int, int, int, int], offsets: dict[str, int]
    ) -> dict[str, torch.Tensor]:
        """Copy the step's bytes in `host` once and return typed device views (the block tables
        (seqs, width)). `shape`: (rows, seqs, width, sampled, placeholders); `offsets`: its
        `layout`."""
        end = offsets["end"]
        if self._device_buffer is None:
            return typed_views(host[:end].clone(), offsets, shape)  # CPU: fresh tensors every step
        if end > self.capacity:
            return typed_views(
                host[:end].pin_memory().to(self.device, non_blocking=True), offsets, shape
            )
        self._device_buffer[:end].copy_(host[:end], non_blocking=True)
        assert self._staged is not None
        self._staged.record(torch.cuda.current_stream(self.device))
        # Views of the one device buffer depend on the step's shape alone: a run of steps of
        # one shape (every decode step of a graph batch) makes them once.
        views = self._views.pop(shape, None)
        if views is None:
            views = typed_views(self._device_buffer, offsets, shape)
            if len(self._views) >= _MAX_CACHED_SHAPES:
                self._views.pop(next(iter(self._views)))  # the least recently used
        self._views[shape] = views
        return views
