"""Builds the model and fills its weights: safetensors (single file or sharded) or dummy.

Every failure names the file at fault: a missing shard, a corrupt header, a tensor the model
does not have, a wrong shape, or tensors the checkpoint lacks.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from safetensors import SafetensorError, safe_open

from pagekeeper_engine.attention.base import AttentionBackend
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.model.fp8 import is_weight_scale
from pagekeeper_engine.model.hf_config import CheckpointError, ModelConfig, read_json
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.model.shard import ShardPlan, TensorSlice

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DUMMY_RANGE = 1e-3  # dummy weights ~ U(-r, r): small enough that deep stacks stay finite

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: str) -> torch.dtype:
    """`--dtype auto`: the checkpoint's half type on CUDA (bf16 if it states none), fp32 on CPU."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"--dtype {requested!r} is not one of {', '.join(_DTYPES)}")
        return _DTYPES[requested]
    if device.startswith("cuda"):
        if checkpoint_dtype in ("bfloat16", "float16"):
            return _DTYPES[checkpoint_dtype]
        return torch.bfloat16
    return torch.float32


class ProgressBar:
    """A one-line progress bar on stderr; on a non-terminal, a line per quarter instead."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None):
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty()
        self.count = 0
        self.started = time.monotonic()
        self.last_drawn = -1.0
        self.last_quarter = -1

    def update(self, n: int = 1) -> None:
        self.count = min(self.count + n, self.total)
        now = time.monotonic()
        if self.is_tty and (now - self.last_drawn >= 0.1 or self.count == self.total):
            self.last_drawn = now
            self.stream.write("\r" + self._line(now))
            if self.count == self.total:
                self.stream.write("\n")
            self.stream.flush()
        quarter = 4 * self.count // self.total
        if not self.is_tty and quarter != self.last_quarter:
            self.last_quarter = quarter
            self.stream.write(self._line(now) + "\n")
            self.stream.flush()

    def _line(self, now: float) -> str:
        width = 30
        filled = width * self.count // self.total
        return (
            f"{self.label} |{'#' * filled}{' ' * (width - filled)}| "
            f"{self.count}/{self.total} {now - self.started:.1f}s"
        )


def find_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when it has one."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
        files = [model_dir / str(name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in {index_path} not found")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors found "
            "(use --load-format dummy for random weights)"
        )
    return files


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc


def iter_safetensors(
    path: Path, device: str, shard: ShardPlan | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one file, read straight onto `device`; with `shard`, only the
    rank's slice of each split tensor is read (never the whole of it)."""
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                part = None if shard is None else shard.slice_of(name)
                if part is not None and is_weight_scale(name):
                    # one scale for the whole tensor covers every rank's slice of it
                    part = None if math.prod(f.get_slice(name).get_shape()) == 1 else part
                if part is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, _read_slice(path, name, f.get_slice(name), part)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc


def _read_slice(path: Path, name: str, handle: Any, part: TensorSlice) -> torch.Tensor:
    """Rows or columns [start, stop) of a checkpoint tensor, after checking its full length."""
    shape = list(handle.get_shape())
    if len(shape) <= part.dim or shape[part.dim] != part.full:
        raise CheckpointError(
            f"{path}: tensor {name!r} has shape {tuple(shape)}, expected {part.full} along "
            f"dimension {part.dim}"
        )
    tensor: torch.Tensor = (
        handle[part.start : part.stop] if part.dim == 0 else handle[:, part.start : part.stop]
    )
    return tensor


def load_safetensors(model: CausalLM, model_dir: Path, device: str, *, progress: bool) -> None:
    """Fill every parameter of `model` from the checkpoint's safetensors files."""
    files = find_weight_files(model_dir)
    names_per_file = {path: _tensor_names(path) for path in files}
    bar = ProgressBar(sum(len(n) for n in names_per_file.values()), "loading weights")
    expected = set(model.checkpoint_shapes())
    loaded: set[str] = set()
    for path in files:
        for name, tensor in iter_safetensors(path, device, model.shard):
            if progress:
                bar.update()
            if model.is_ignored_weight(name):
                continue
            try:
                model.load_weight(name, tensor)
            except KeyError as exc:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is not part of a {model.config.arch} model "
                    "with this config.json"
                ) from exc
            except ValueError as exc:
                raise CheckpointError(f"{path}: {exc}") from exc
            loaded.add(name)
    missing = sorted(expected - loaded) + [
        f"{linear}.weight_scale" for linear in model.missing_weight_scales()
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise CheckpointError(
            f"{model_dir}: {len(missing)} tensors missing from "
            f"{', '.join(p.name for p in files)}: {shown}"
        )


@torch.no_grad()
def fill_dummy(model: CausalLM, seed: int) -> None:
    """Random weights at the real shapes: norms at 1, everything else U(-r, r), seeded.

    Drawn per checkpoint tensor at its whole size, then cut to this rank's slice, so every
    tensor-parallel size gets the same model (one tensor at a time is whole on a rank)."""
    generator: torch.Generator | None = None
    for name, shape in model.checkpoint_shapes().items():
        part = model.shard.slice_of(name)
        full_shape = list(shape)
        if part is not None:
            full_shape[part.dim] = part.full
        device = model.lm_head_weight.device
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(seed)
        full = torch.empty(full_shape, dtype=model.lm_head_weight.dtype, device=device)
        if name.endswith("norm.weight"):
            full.fill_(1.0)
        else:
            full.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
        model.load_weight(
            name, full if part is None else full.narrow(part.dim, part.start, part.length)
        )


def load_model(
    model_config: ModelConfig,
    model_dir: str | Path,
    *,
    load_format: str,
    dtype: torch.dtype,
    device: str,
    backend: AttentionBackend,
    max_position: int,
    seed: int = 0,
    progress: bool = True,
    tp: TensorParallelGroup | None = None,
    quantization: str = "none",
    offload_layer_ids: Sequence[int] = (),
) -> CausalLM:
    """Build the model (or rank `tp.rank`'s shard of it) on `device` in `dtype`, its
    projections' weights in FP8 under `quantization="fp8"` (`model/fp8.py`), and fill its
    weights as `load_format` says; the projections of `offload_layer_ids` in pinned host
    memory, staged to the GPU ahead of use (`model/offload.py`)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"--load-format {load_format!r} is not one of auto, safetensors, dummy")
    with torch.device(device):
        model = CausalLM(
            model_config, max_position, backend, dtype, tp, quantization, offload_layer_ids
        )
    if load_format == "dummy":
        fill_dummy(model, seed)
    else:
        load_safetensors(model, Path(model_dir), device, progress=progress)
    model.model.start_offload()
    return model.eval()
