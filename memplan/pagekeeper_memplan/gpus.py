"""GPU products: their memory and compute capability, from a name or a node's labels.

NVIDIA GPU feature discovery labels each GPU node with `nvidia.com/gpu.product` (the product
name with spaces as dashes, e.g. `NVIDIA-H100-80GB-HBM3`) and `nvidia.com/gpu.memory` (the
memory nvidia-smi reports, in MiB). The label's memory wins over the table below, which holds
nvidia-smi's figure for each product. It is a little above what CUDA reports as the device's
total (the driver keeps some back: about 0.6% on an H100 or H200), an overestimate that the
plan's accuracy run calibrates.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
FP8_CAPABILITY = (8, 9)  # Ada and Hopper and newer have FP8 tensor cores


@dataclass(frozen=True)
class GpuModel:
    """One GPU: its name, memory in bytes and (where known) compute capability."""

    name: str
    memory_bytes: int
    capability: tuple[int, int] | None

    @property
    def supports_fp8(self) -> bool | None:
        """Whether it has FP8 (compute capability 8.9 or newer); None when unknown."""
        if self.capability is None:
            return None
        return self.capability >= FP8_CAPABILITY


@dataclass(frozen=True)
class _Product:
    family: str  # the name's token that identifies it, upper case
    qualifier: str | None  # a second token that must be present too (a memory size, NVL)
    name: str
    memory_mib: int
    capability: tuple[int, int]


# Most specific first: a family with a qualifier before the same family without one.
PRODUCTS: tuple[_Product, ...] = (
    _Product("B200", None, "B200", 183359, (10, 0)),
    _Product("H200", None, "H200-141GB", 143771, (9, 0)),
    _Product("H100", "NVL", "H100-NVL-94GB", 95830, (9, 0)),
    _Product("H100", None, "H100-80GB", 81559, (9, 0)),
    _Product("A100", "40GB", "A100-40GB", 40960, (8, 0)),
    _Product("A100", None, "A100-80GB", 81920, (8, 0)),
    _Product("L40S", None, "L40S", 46068, (8, 9)),
    _Product("L40", None, "L40", 46068, (8, 9)),
    _Product("L4", None, "L4", 23034, (8, 9)),
    _Product("A10G", None, "A10G", 23028, (8, 6)),
    _Product("A10", None, "A10", 23028, (8, 6)),
    _Product("T4", None, "T4", 15360, (7, 5)),
)


def _tokens(name: str) -> list[str]:
    return [t for t in name.upper().replace(" ", "-").replace("_", "-").split("-") if t]


def parse_product(name: str) -> GpuModel | None:
    """The GPU a product name or label value names (`NVIDIA-H100-80GB-HBM3`, `H100-80GB`,
    `h200`, `NVIDIA A100-SXM4-40GB`); None for one the table does not know, and for a MIG
    slice (its memory is the slice's, which only its own label says)."""
    tokens = _tokens(name)
    if "MIG" in tokens or any(t.startswith("MIG") for t in tokens):
        return None
    for product in PRODUCTS:
        if product.family in tokens and (product.qualifier is None or product.qualifier in tokens):
            return GpuModel(product.name, product.memory_mib * MiB, product.capability)
    return None


def gpu_from_labels(labels: dict[str, str]) -> GpuModel | None:
    """The GPU a node's feature-discovery labels describe; None when they say nothing usable.
    The memory label wins over the product table; a product the table does not know keeps an
    unknown compute capability."""
    product_label = labels.get(PRODUCT_LABEL, "")
    product = parse_product(product_label) if product_label else None
    memory_text = labels.get(MEMORY_LABEL, "")
    if memory_text.isdigit() and int(memory_text) > 0:
        memory = int(memory_text) * MiB
        name = product_label or "unknown product"
        return GpuModel(name, memory, None if product is None else product.capability)
    if product is None:
        return None
    return GpuModel(product_label, product.memory_bytes, product.capability)


def smallest(gpus: list[GpuModel]) -> GpuModel | None:
    """The GPU with the least memory (a pod may land on any of them); None for none."""
    return min(gpus, key=lambda g: g.memory_bytes) if gpus else None
