"""CPU weight offload (`--cpu-offload-gb`): the offloaded layers' projection weights live in
pinned host memory and are streamed into GPU staging buffers ahead of use, on a side stream.

Which layers: `model/offload_plan.py`. The offloaded layers are built in host memory (so the
GPU never holds their weights, not even while loading) and the rest of each such layer (norms,
biases, FP8 scales) is moved to the GPU. Once loaded, each offloaded projection's `weight` is
re-pointed at its slot in one of `NUM_STAGING` staging buffers, offloaded layer j using buffer
j % NUM_STAGING, so every kernel that reads `linear.weight` reads the staged copy.

Per forward pass, with the model's calls in order (`start` once, then `begin(i)` before layer
i's first projection and `end(i)` after its last):

    start      the side stream waits for the compute stream (the previous step is done with
               every buffer) and copies offloaded layers 0 and 1 into buffers 0 and 1
    begin(o_j) the compute stream waits for layer o_j's copy
    end(o_j)   the compute stream records that buffer j % 2 is free; the side stream waits
               for it and copies offloaded layer j + 2 into it

so the copy of offloaded layer j + 2 runs beside the compute of everything from o_j's end to
o_{j+2}'s start. Copies from pinned memory run asynchronously over the host link; the events
order them against the compute. The steps run eagerly under offload: the runner captures no
CUDA graphs (a copy issued in one captured piece and awaited in another would cross graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from pagekeeper_engine.model.hf_config import ModelConfig
from pagekeeper_engine.model.layers import Linear
from pagekeeper_engine.model.offload_plan import (
    NUM_STAGING,
    OffloadPlan,
    linear_params_per_layer,
    plan_offload,
)

logger = logging.getLogger(__name__)


def projections(layer: nn.Module) -> list[Linear]:
    """A decoder layer's projections, in a fixed order: qkv, o, gate/up, down."""
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    found = [layer.get_submodule(name) for name in names]
    assert all(isinstance(m, Linear) for m in found), "a decoder layer's projections are Linear"
    return [m for m in found if isinstance(m, Linear)]


def move_to_host(layer: nn.Module, device: torch.device) -> None:
    """A layer built on the CPU: its projections' weights into pinned host memory (uninitialized:
    the loader fills them), everything else of it onto `device`."""
    offloaded = {id(linear) for linear in projections(layer)}
    for module in layer.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(module) in offloaded and name == "weight":
                pinned = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=True)
                setattr(module, name, nn.Parameter(pinned, requires_grad=False))
            else:
                setattr(module, name, nn.Parameter(param.to(device), requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(device))


class LayerOffload:
    """The staging buffers, the side stream and the events of the offloaded layers' weights
    (`layer_ids`, ascending, of `layers`); made once they are loaded."""

    def __init__(self, layers: nn.ModuleList, layer_ids: Sequence[int], device: torch.device):
        assert layer_ids, "offload at least one layer"
        self.ordinal = {layer_id: j for j, layer_id in enumerate(layer_ids)}
        # (offloaded layer, projection): the pinned host copy of its weight
        self.hosts = [[linear.weight.data for linear in projections(layers[i])] for i in layer_ids]
        for hosts in self.hosts:
            assert [h.shape for h in hosts] == [h.shape for h in self.hosts[0]], (
                "every offloaded layer has the same projection shapes"
            )
            assert all(h.is_pinned() for h in hosts), "offloaded weights are in pinned memory"
        self.num_staging = min(NUM_STAGING, len(layer_ids))
        self.staging = [
            [torch.empty(h.shape, dtype=h.dtype, device=device) for h in self.hosts[0]]
            for _ in range(self.num_staging)
        ]
        for j, layer_id in enumerate(layer_ids):
            slots = self.staging[j % self.num_staging]
            for linear, staged in zip(projections(layers[layer_id]), slots, strict=True):
                linear.weight = nn.Parameter(staged, requires_grad=False)
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.copied = [torch.cuda.Event() for _ in layer_ids]  # type: ignore[no-untyped-call]
        self.released = [
            torch.cuda.Event()  # type: ignore[no-untyped-call]
            for _ in range(self.num_staging)
        ]

    @property
    def staging_bytes(self) -> int:
        return sum(t.nbytes for slots in self.staging for t in slots)

    def start(self) -> None:
        """A forward pass begins: fill every staging buffer with the first offloaded layers."""
        self.stream.wait_stream(torch.cuda.current_stream())
        for j in range(self.num_staging):
            self._copy(j, after=None)

    def begin(self, layer_id: int) -> None:
        """Layer `layer_id` is about to run: the compute waits for its weights' copy."""
        j = self.ordinal.get(layer_id)
        if j is not None:
            torch.cuda.current_stream().wait_event(self.copied[j])

    def end(self, layer_id: int) -> None:
        """Layer `layer_id` has been enqueued: its buffer is free once it runs, for the
        offloaded layer `num_staging` on."""
        j = self.ordinal.get(layer_id)
        if j is None:
            return
        slot = j % self.num_staging
        self.released[slot].record()
        if j + self.num_staging < len(self.hosts):
            self._copy(j + self.num_staging, after=self.released[slot])

    def _copy(self, j: int, after: torch.cuda.Event | None) -> None:
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for staged, host in zip(self.staging[j % self.num_staging], self.hosts[j], strict=True):
                staged.copy_(host, non_blocking=True)
            self.copied[j].record(self.stream)


def plan_for_model(
    offload_gib: float, config: ModelConfig, bytes_per_weight: int, device: torch.device
) -> OffloadPlan:
    """The offload plan of (this rank's shard of) a model whose projection weights take
    `bytes_per_weight` bytes each; none on the CPU, where there is no GPU memory to save."""
    params = linear_params_per_layer(
        config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    )
    if device.type != "cuda":
        if offload_gib > 0:
            logger.info(
                "--cpu-offload-gb %s ignored: the weights are already in host memory on the CPU",
                offload_gib,
            )
        return OffloadPlan((), params * bytes_per_weight)
    plan = plan_offload(config.num_layers, params * bytes_per_weight, offload_gib)
    if plan.layer_ids:
        logger.info("CPU weight offload: %s; CUDA graphs off", plan.describe())
    return plan
