"""The model runner's start-up, in stages, each on what the ones before it left: the device, the
model (this rank's shard of its weights), the memory a step works in, the timed kernel choices
and the budget they leave, the KV cache with its swap pool and host tier, the CUDA graphs.

`RunnerSetup` holds what the stages leave; `runner.ModelRunner` adds the step path over it, so
the loop, the tests and the benchmarks read one object.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pagekeeper_engine.attention.registry import get_backend
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.limits import EngineLimits, resolve_limits
from pagekeeper_engine.distributed.group import TensorParallelGroup, choose_all_reduce
from pagekeeper_engine.faults import (
    INJECT_STEP_HANG_ENV,
    StepFaultInjection,
    injected_fault_step,
    wait_forever,
)
from pagekeeper_engine.memory.budget import RankBudgets
from pagekeeper_engine.memory.cuda import CudaAllocatorMonitor
from pagekeeper_engine.memory.profile import ProfileShapes
from pagekeeper_engine.model.fp8 import weight_quantization
from pagekeeper_engine.model.hf_config import load_eos_token_ids, load_model_config
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.model.loader import load_model, resolve_dtype
from pagekeeper_engine.model.offload import plan_for_model
from pagekeeper_engine.model.shard import ShardPlan
from pagekeeper_engine.model.workspace import Workspace, WorkspaceShape
from pagekeeper_engine.runner.cuda_graphs import StepGraphs, graph_batch_sizes
from pagekeeper_engine.runner.kernel_choice import KernelChoices, choose_kernels
from pagekeeper_engine.runner.kv_blocks import decide_num_gpu_blocks
from pagekeeper_engine.runner.kv_cache import (
    KVPools,
    describe_kv_scales,
    kv_layout,
    pool_shape,
    resolve_kv_cache_dtype,
)
from pagekeeper_engine.runner.kv_offload import HostKVPool, host_tier_blocks
from pagekeeper_engine.runner.piecewise_graphs import piecewise_token_sizes
from pagekeeper_engine.runner.profile_target import RunnerProfileTarget
from pagekeeper_engine.runner.sampler import Sampler, SamplerBuffers
from pagekeeper_engine.runner.shard_pick import shard_picker_for
from pagekeeper_engine.runner.step_faults import StepFollowers
from pagekeeper_engine.runner.step_inputs import StepInputBuilder
from pagekeeper_engine.runner.step_launch import StepLauncher
from pagekeeper_engine.runner.step_results import HostResultBuffers
from pagekeeper_engine.runner.structured_output import GrammarMasks

logger = logging.getLogger(__name__)


class RunnerSetup:
    """A runner's model, KV cache and graphs on one device, as its start-up stages leave them
    (one rank's shard under tensor parallelism)."""

    limits: EngineLimits

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.limits.max_num_batched_tokens

    def __init__(
        self,
        config: EngineConfig,
        *,
        progress: bool = True,
        tp: TensorParallelGroup | None = None,
        followers: StepFollowers | None = None,
    ):
        """Set up in stages, each on what the ones before it left: the device, the model, the
        memory a step works in, the kernels it runs and the budget they leave, the KV cache,
        the graphs. Under tensor parallelism every rank takes the same stages in lockstep (the
        budget, the block count and the graphs run collectives)."""
        self.config = config
        self.tp = tp if tp is not None else TensorParallelGroup()
        self.followers = followers
        self.memory_budget: RankBudgets | None = None
        self._set_up_device()
        vocab_size = self._load(progress)
        # Before the memory profile and the graphs: they measure and capture the path chosen.
        self.all_reduce_choice = choose_all_reduce(
            self.tp,
            self.config.disable_custom_all_reduce,
            self.model_config.hidden_size,
            self.dtype,
            self.max_num_batched_tokens,
        )
        self._set_up_memory(vocab_size)
        self._allocate_kv_cache()
        if self.uses_graphs:
            self.capture_graphs()

    def _set_up_device(self) -> None:
        self.device = torch.device(self.config.device)
        if self.device.type == "cuda" and self.tp.size > 1:
            self.device = torch.device("cuda", self.tp.rank)  # one GPU per rank
        self.free_at_start: int | None = None  # the device's free bytes before anything of ours
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            self.free_at_start = torch.cuda.mem_get_info(self.device)[0]
        self.allocator_monitor = (
            CudaAllocatorMonitor(self.device) if self.device.type == "cuda" else None
        )

    def _load(self, progress: bool) -> int:
        """The model's configuration, this rank's shard of its weights, and the limits; the
        whole model's vocabulary size."""
        config = self.config
        model_dir = Path(config.model)
        full_config = load_model_config(model_dir)
        # This rank's part of the model (all of it at size 1): the KV pool, the workspace and
        # the budget are sized from it.
        shard = ShardPlan.for_rank(full_config, self.tp.rank, self.tp.size)
        self.model_config = shard.local_config
        self.dtype = resolve_dtype(config.dtype, full_config.torch_dtype, config.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config, self.dtype, self.device)
        self.quantization = weight_quantization(
            config.quantization, model_dir, self.dtype, self.device
        )
        bytes_per_weight = 1 if self.quantization == "fp8" else self.dtype.itemsize
        self.offload_plan = plan_for_model(
            config.cpu_offload_gb, self.model_config, bytes_per_weight, self.device
        )
        self.limits = resolve_limits(config, full_config.max_position_embeddings)
        self.block_size = config.block_size
        self.eos_token_ids = load_eos_token_ids(model_dir)
        self.model: CausalLM = load_model(
            full_config,
            model_dir,
            load_format=config.load_format,
            dtype=self.dtype,
            device=str(self.device),
            backend=get_backend(config.device),
            max_position=self.max_model_len,
            seed=config.seed,
            progress=progress,
            tp=self.tp,
            quantization=self.quantization,
            offload_layer_ids=self.offload_plan.layer_ids,
        )
        # Loading leaves its transient tensors cached (dummy weights are drawn whole and cut to
        # this rank's slice); the workspace, the sampler's rows and the KV pool must not carve
        # the rest of those segments, which would stay reserved and never be used.
        self.release_cached_memory()
        return full_config.vocab_size

    def _set_up_memory(self, vocab_size: int) -> None:
        """The memory every step works in, allocated once, then the budget it leaves for the
        KV cache (measured on a GPU: it counts these buffers as activations)."""
        config = self.config
        # The forward pass's static home, before the profile: it is part of the activations.
        self.workspace = Workspace(
            WorkspaceShape.for_model(
                self.model_config,
                max(self.max_num_batched_tokens, *graph_batch_sizes(config.max_num_seqs)),
            ),
            self.dtype,
            self.device,
        )
        self.model.bind_workspace(self.workspace)
        # Sampling's rows, beside the workspace and before the profile: part of the activations.
        # Only rank 0 samples whole logits; under tensor parallelism every rank also holds its
        # vocabulary shard's rows (`shard_pick`).
        self.sampler_buffers = SamplerBuffers(
            config.max_num_seqs, vocab_size if self.tp.is_first else 0, self.dtype, self.device
        )
        self.sampler = Sampler(self.device, config.seed, self.eos_token_ids, self.sampler_buffers)
        self.sampler.grammar = GrammarMasks(
            Path(config.model), vocab_size, self.eos_token_ids, config.max_num_seqs, self.device
        )
        self.kv_layout = kv_layout(self.model_config, self.block_size, self.kv_cache_dtype)
        self.bytes_per_block = self.kv_layout.bytes_per_block
        self.inputs = StepInputBuilder(
            self.device,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_tokens=self.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
        )
        self.steps = StepLauncher(  # its graphs are captured once the KV cache is bound
            self.model,
            self.inputs,
            self.sampler,
            HostResultBuffers(self.device, config.max_num_seqs),
            self.tp,
            shard_picker_for(self.model, config.max_num_seqs, config.seed, self.eos_token_ids),
        )
        # Under CPU offload the steps run eagerly (`model/offload.py`), and nothing is timed in
        # graphs.
        is_offloading = bool(self.offload_plan.layer_ids)
        self.uses_graphs = (
            self.device.type == "cuda" and not config.enforce_eager and not is_offloading
        )
        self._faults = StepFaultInjection(
            self.tp.rank,
            injected_fault_step(self.tp.rank, os.environ),
            injected_fault_step(self.tp.rank, os.environ, INJECT_STEP_HANG_ENV),
            hang=self._hang_device if self.device.type == "cuda" else wait_forever,
        )
        shapes = ProfileShapes(
            self.max_num_batched_tokens, config.max_num_seqs, self.max_model_len, self.block_size
        )
        self.profile_target = RunnerProfileTarget(
            self.steps,
            self.workspace.nbytes + self.steps.sampling_nbytes,
            lambda num_blocks: pool_shape(self.model_config, self.block_size, num_blocks),
            self.kv_cache_dtype,
            self.device,
            self.capture_graphs,
            self.release_graphs,
        )
        chosen = (
            KernelChoices()
            if is_offloading
            else choose_kernels(self.model, self.inputs, self.tp, self.profile_target, self.device)
        )
        self.gemv_choices, self.fusion_choice = chosen.gemv, chosen.fusion
        # What the timing left allocated (cuBLAS's workspaces) is the steps' memory, not weights.
        self.profile_target.workspace_bytes += chosen.kept_bytes
        self.release_cached_memory()  # the timing graphs' and the scratch cache's segments
        self.num_gpu_blocks, self.memory_budget = decide_num_gpu_blocks(
            self.profile_target,
            config,
            self.tp,
            self.device,
            self.kv_layout,
            shapes,
            self.free_at_start,
        )

    def _allocate_kv_cache(self) -> None:
        """The device pool of `num_gpu_blocks`, bound to the layers, and the swap pool."""
        config = self.config
        self.num_cpu_blocks = (
            config.num_cpu_blocks_override
            if config.num_cpu_blocks_override is not None
            else int(config.swap_space * 2**30) // self.bytes_per_block
        )
        self.pools = KVPools(
            self.model_config,
            self.block_size,
            self.num_gpu_blocks,
            self.num_cpu_blocks,
            self.kv_cache_dtype,
            self.device,
        )
        num_host_blocks = host_tier_blocks(
            config.kv_offloading_size, self.tp.size, self.bytes_per_block
        )
        self.host_tier = (
            HostKVPool(self.pools.device_pool, num_host_blocks) if num_host_blocks > 0 else None
        )
        self.model.bind_kv_cache(self.pools.layer_caches())
        logger.info(describe_kv_scales(self.model.checkpoint_kv_scales, self.kv_cache_dtype))
        logger.info(
            "KV cache: %d device blocks, %d swap blocks, %d host tier blocks of %d tokens, %s "
            "(%d bytes per block)",
            self.num_gpu_blocks,
            self.num_cpu_blocks,
            self.num_host_blocks,
            self.block_size,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.bytes_per_block,
        )

    @property
    def graphs(self) -> StepGraphs | None:
        """The captured decode and mixed-step graphs (None while steps run eagerly)."""
        return self.steps.graphs

    @graphs.setter
    def graphs(self, graphs: StepGraphs | None) -> None:
        self.steps.graphs = graphs

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host KV tier (0: no tier)."""
        return self.host_tier.num_blocks if self.host_tier is not None else 0

    @property
    def host_block_bytes(self) -> int:
        """One host tier block's bytes over every rank (each holds its shard)."""
        return self.bytes_per_block * self.tp.size

    @property
    def memory_budget_bytes(self) -> list[dict[str, int]] | None:
        """The start-up budget's terms, one dict per rank (None when the block count was given
        or on the CPU)."""
        return None if self.memory_budget is None else self.memory_budget.terms

    def capture_graphs(self) -> int:
        """Capture the decode and mixed-step graphs over the bound KV cache; their pool's
        bytes (0 when this runner runs eagerly)."""
        if not self.uses_graphs:
            return 0
        self.graphs = StepGraphs(
            self.model,
            self.inputs,
            graph_batch_sizes(self.config.max_num_seqs),
            piecewise_token_sizes(self.max_num_batched_tokens),
            self.steps.logits_out,
        )
        self.graphs.capture()
        return self.graphs.pool_bytes

    def release_graphs(self) -> None:
        self.graphs = None

    def _hang_device(self) -> None:
        """The injected hang on a GPU: a kernel that spins for decades, and a wait for it inside
        CUDA, as a wedged device or collective leaves the step."""
        torch.cuda._sleep(1 << 62)  # type: ignore[no-untyped-call]  # clock cycles
        torch.cuda.synchronize(self.device)

    def release_cached_memory(self) -> None:
        """Hands the caching allocator's wholly free segments back to the device."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
