"""Which decoder layers `--cpu-offload-gb` keeps in host memory. Pure arithmetic, no torch.

Whole layers' linear weights (q/k/v, o, gate/up, down) are offloaded: enough layers to cover the
request, rounded up, so at least the asked bytes leave the GPU. Each forward pass streams every
offloaded layer back into one of `NUM_STAGING` GPU buffers shaped like one layer's weights,
ahead of its use, on a side stream (`model/offload.py`).

The offloaded layers are spread evenly over the depth (every k-th layer), not taken from the
end: a layer's copy can start only when the staging buffer it fills is released by the
offloaded layer two before it, and runs while the layers between them compute. Spread out, each
copy has k - 1 resident layers beside the offloaded one to hide behind; the last n layers
offloaded together would leave each copy only one offloaded layer's compute to overlap, and the
step would wait on the host link for nearly all of their bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1 << 30
NUM_STAGING = 2  # GPU buffers of one layer's weights: one in use while the next one fills


class OffloadError(ValueError):
    """The offload cannot be planned; the message names `--cpu-offload-gb`."""


@dataclass(frozen=True)
class OffloadPlan:
    """The offloaded layers (ascending) and the bytes of one layer's linear weights."""

    layer_ids: tuple[int, ...]
    layer_bytes: int

    @property
    def offloaded_bytes(self) -> int:
        """Host memory (pinned) the offloaded weights take."""
        return len(self.layer_ids) * self.layer_bytes

    @property
    def staging_bytes(self) -> int:
        """GPU memory the staging buffers take (counted in the budget's weights)."""
        return min(NUM_STAGING, len(self.layer_ids)) * self.layer_bytes

    @property
    def saved_bytes(self) -> int:
        """GPU memory the offload frees: the offloaded weights less the staging buffers."""
        return self.offloaded_bytes - self.staging_bytes

    def describe(self) -> str:
        return (
            f"{len(self.layer_ids)} layers {list(self.layer_ids)} in host memory "
            f"({self.offloaded_bytes / GiB:.2f} GiB), {self.staging_bytes / GiB:.2f} GiB of GPU "
            f"staging: {self.saved_bytes / GiB:.2f} GiB saved"
        )


def linear_params_per_layer(
    hidden_size: int, q_size: int, kv_size: int, intermediate_size: int
) -> int:
    """Weights of one decoder layer's projections: q/k/v, o, and gate/up/down."""
    return (
        hidden_size * (q_size + 2 * kv_size)
        + q_size * hidden_size
        + 3 * hidden_size * (intermediate_size)
    )


def plan_offload(num_layers: int, layer_bytes: int, offload_gib: float) -> OffloadPlan:
    """The layers that hold `offload_gib` GiB of linear weights (rounded up to whole layers),
    spread evenly: layer floor((j + 1) L / n) - 1 for j < n, so the last layer is one of them
    and the first n - 1 are evenly spaced before it. OffloadError when the request exceeds
    every layer's linear weights."""
    assert num_layers > 0 and layer_bytes > 0, (num_layers, layer_bytes)
    if offload_gib < 0:
        raise OffloadError(f"--cpu-offload-gb {offload_gib} is negative")
    if offload_gib == 0:
        return OffloadPlan((), layer_bytes)
    num_offloaded = math.ceil(offload_gib * GiB / layer_bytes)
    if num_offloaded > num_layers:
        raise OffloadError(
            f"--cpu-offload-gb {offload_gib} exceeds the linear weights of all {num_layers} "
            f"layers ({num_layers * layer_bytes / GiB:.2f} GiB at {layer_bytes / GiB:.3f} GiB "
            "a layer on this GPU)"
        )
    layer_ids = tuple((j + 1) * num_layers // num_offloaded - 1 for j in range(num_offloaded))
    return OffloadPlan(layer_ids, layer_bytes)
