"""How one checkpoint splits over `size` tensor-parallel ranks. Pure arithmetic, no torch.

Column-parallel projections (q/k/v, gate/up) keep a slice of their output rows on each rank;
row-parallel ones (o, down) a slice of their input columns, and their partial sums are
all-reduced. Attention heads split evenly; with fewer KV heads than ranks each KV head is
replicated on `size // num_kv_heads` consecutive ranks (rank r holds KV head
r // (size // num_kv_heads)), so every rank keeps the query heads that read it. The embedding and
the LM head split the vocabulary into equal shards of `ceil(vocab / size)` rows; the last shard's
rows past the vocabulary are zero padding, and gathered logits are cut back to the vocabulary.
Norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from pagekeeper_engine.model.hf_config import ModelConfig
from pagekeeper_memplan.shape import ModelShape, RankShape, split_error

# Checkpoint projection -> (the dimension it is split on, what its slice counts).
_SPLITS: dict[str, tuple[int, Literal["q", "kv", "mlp", "vocab"]]] = {
    "q_proj": (0, "q"),
    "k_proj": (0, "kv"),
    "v_proj": (0, "kv"),
    "o_proj": (1, "q"),
    "gate_proj": (0, "mlp"),
    "up_proj": (0, "mlp"),
    "down_proj": (1, "mlp"),
    "embed_tokens": (0, "vocab"),
    "lm_head": (0, "vocab"),
}


# Tensors with one entry per output row of their projection (or a single one): column-parallel
# ones split with those rows, row-parallel ones stay whole.
_PER_OUTPUT_ROW = ("bias", "weight_scale", "weight_scale_inv")
# An FP8 checkpoint's static activation scale: one number for the projection's whole input.
_UNSPLIT = ("input_scale",)


class ShardError(ValueError):
    """The model's shapes do not split over this many ranks; the message says which."""


@dataclass(frozen=True)
class TensorSlice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a checkpoint tensor, and the length
    that dimension has in the checkpoint."""

    dim: int
    start: int
    stop: int
    full: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds of one model."""

    config: ModelConfig  # the whole model's
    rank: int
    size: int

    @staticmethod
    def for_rank(config: ModelConfig, rank: int, size: int) -> ShardPlan:
        check_divisible(config, size)
        assert 0 <= rank < size, f"rank {rank} of {size}"
        return ShardPlan(config, rank, size)

    @property
    def rank_shape(self) -> RankShape:
        """What each rank holds, as the memory plan counts it."""
        return RankShape(self.config, self.size)

    @property
    def num_heads(self) -> int:
        return self.rank_shape.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.rank_shape.num_kv_heads

    @property
    def kv_head_start(self) -> int:
        """The first KV head (in the checkpoint's order) this rank holds."""
        total = self.config.num_kv_heads
        if total >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // total)

    @property
    def intermediate_size(self) -> int:
        return self.rank_shape.intermediate_size

    @property
    def vocab_shard(self) -> int:
        """Rows of the embedding and LM head on every rank (the last one padded)."""
        return self.rank_shape.vocab_shard

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    @property
    def vocab_columns(self) -> tuple[int, int]:
        """[start, stop) of the vocabulary this rank's shard holds: shorter than `vocab_shard`
        on the last rank (its padding), or empty."""
        start = min(self.vocab_start, self.config.vocab_size)
        return start, min(self.vocab_start + self.vocab_shard, self.config.vocab_size)

    def of_rank(self, rank: int) -> ShardPlan:
        """The same model's plan for another rank of the group."""
        return ShardPlan.for_rank(self.config, rank, self.size)

    @property
    def local_config(self) -> ModelConfig:
        """The model as this rank builds it: its heads, MLP columns and vocabulary shard."""
        return replace(
            self.config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_shard,
        )

    def slice_of(self, name: str) -> TensorSlice | None:
        """This rank's part of checkpoint tensor `name` (Hugging Face naming); None when every
        rank holds all of it. A vocabulary slice may be shorter than `vocab_shard` (the last
        rank's padding) or empty."""
        if self.size == 1:
            return None
        parts = name.split(".")
        owner = parts[-2] if len(parts) >= 2 else ""
        if owner not in _SPLITS:
            return None
        dim, unit = _SPLITS[owner]
        if parts[-1] in _UNSPLIT:
            return None
        if dim == 1 and parts[-1] in _PER_OUTPUT_ROW:
            # a row-parallel projection's bias or FP8 weight scales are per output row, and
            # every rank has all of its rows: kept whole on every rank
            return None
        cfg = self.config
        if unit == "q":
            width = self.num_heads * cfg.head_dim
            return TensorSlice(dim, self.rank * width, (self.rank + 1) * width, cfg.q_size)
        if unit == "kv":
            start = self.kv_head_start * cfg.head_dim
            return TensorSlice(dim, start, start + self.num_kv_heads * cfg.head_dim, cfg.kv_size)
        if unit == "mlp":
            width = self.intermediate_size
            return TensorSlice(
                dim, self.rank * width, (self.rank + 1) * width, cfg.intermediate_size
            )
        start, stop = self.vocab_columns
        return TensorSlice(dim, start, stop, cfg.vocab_size)


def check_divisible(shape: ModelShape, size: int) -> None:
    """Raise ShardError naming the shape that `--tensor-parallel-size size` cannot split (the
    memory plan's `split_error`, so the operator refuses the same sizes)."""
    reason = split_error(shape, size)
    if reason is not None:
        raise ShardError(f"--tensor-parallel-size {size}: {reason}")
