"""The model runner: owns the model, the KV cache pool, the swap pool and the sampler.

It consumes the scheduler's plain `SchedulerOutput`, turns it into packed tensors and
`AttentionMetadata`, runs the forward pass, computes logits only for the rows that are sampled,
and returns plain token ids. It makes no scheduling decision of its own.

`launch` enqueues a step (`step_launch.py`) and returns before the device has run it: the
sampled ids stay on the device (the next step's placeholder inputs gather from them there) and
travel to the host as `step_results.py` describes. `execute` is `launch(...).result()`.

Under tensor parallelism there is one runner per rank, each over its shard of the model and of
every KV block (`model/shard.py`). Rank 0's runner, in the engine core, hands each step to
`followers` (the other ranks, `executor/workers.py`) before it runs it; every rank then runs the
same forward in lockstep. The ranks pick the common batches across their vocabulary shards
(`shard_pick.py`); rank 0 samples the others and broadcasts the ids, so every rank's next step
reads the same placeholders.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from pagekeeper_engine.attention.registry import get_backend
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.kv_copies import StepCopies
from pagekeeper_engine.core.limits import EngineLimits, resolve_limits
from pagekeeper_engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.distributed.group import TensorParallelGroup, choose_all_reduce
from pagekeeper_engine.faults import (
    INJECT_STEP_HANG_ENV,
    FatalEngineError,
    StepFaultInjection,
    injected_fault_step,
    wait_forever,
)
from pagekeeper_engine.memory.budget import RankBudgets
from pagekeeper_engine.memory.cuda import CudaAllocatorMonitor
from pagekeeper_engine.memory.oom import DeviceOutOfMemoryError
from pagekeeper_engine.memory.profile import ProfileShapes
from pagekeeper_engine.model.fp8 import weight_quantization
from pagekeeper_engine.model.hf_config import load_eos_token_ids, load_model_config
from pagekeeper_engine.model.llama import CausalLM
from pagekeeper_engine.model.loader import load_model, resolve_dtype
from pagekeeper_engine.model.offload import plan_for_model
from pagekeeper_engine.model.shard import ShardPlan
from pagekeeper_engine.model.workspace import Workspace, WorkspaceShape
from pagekeeper_engine.runner.cuda_graphs import StepGraphs, graph_batch_sizes
from pagekeeper_engine.runner.follower_step import FollowerStep, follower_step
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
from pagekeeper_engine.runner.step_faults import (
    FatalOnFailure,
    StepFollowers,
    tensor_parallel_failure,
)
from pagekeeper_engine.runner.step_inputs import StepInputBuilder, StepInputs
from pagekeeper_engine.runner.step_launch import StepLauncher
from pagekeeper_engine.runner.step_results import HostResultBuffers, LaunchedStep, PendingStep
from pagekeeper_engine.runner.structured_output import GrammarMasks

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs scheduled steps of one model (or one rank's shard of it) on one device over a
    preallocated paged KV cache."""

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
    def prefers_async_scheduling(self) -> bool:
        """Overlapping the host's work with the device's pays on CUDA (on the CPU the two are
        the same cores)."""
        return self.device.type == "cuda"

    def check_sampling(self, params: SamplingParams) -> None:
        """RequestRejectedError for parameters this runner cannot honour (a schema that does not
        compile), before the request runs."""
        assert self.sampler.grammar is not None
        self.sampler.grammar.check(params)

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
    def kv_load_seconds(self) -> float:
        """Device seconds the host tier's finished loads took."""
        return self.host_tier.load_seconds if self.host_tier is not None else 0.0

    @property
    def num_swap_ooms(self) -> int:
        """Swaps that ran out of device memory and fell back to a slow copy."""
        return self.pools.num_swap_ooms

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

    # -- one step ----------------------------------------------------------------------------

    def prepare_inputs(self, seqs: Sequence[ScheduledSeq]) -> StepInputs:
        """The step's packed inputs, as a launch builds them (`StepLauncher.prepare`)."""
        return self.steps.prepare(seqs)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Apply the step's swaps, run the forward pass, sample where asked, and wait.

        Out of device memory, it frees what the step allocated and raises
        DeviceOutOfMemoryError: the KV cache is as before the step (the scheduler retries it).
        """
        return self.launch(out).result()

    def launch(self, out: SchedulerOutput) -> LaunchedStep | FatalOnFailure:
        """`execute` without the wait: the step is enqueued on the device (and handed to the
        other ranks first). Under tensor parallelism every failure of the step, here or while
        its tokens come back, ends the engine (`step_failure`)."""
        try:
            pending = self._launch(out)
        except FatalEngineError:
            raise
        except Exception as exc:
            if self.tp.size > 1:
                raise self.step_failure(exc) from exc
            if not isinstance(exc, torch.OutOfMemoryError):
                raise
            detail = str(exc)
        else:
            return pending if self.tp.size == 1 else FatalOnFailure(pending, self.step_failure)
        # Leaving the except block dropped the traceback, and with it the frames that held the
        # step's tensors; only now can their memory go back to the allocator and the device.
        self.release_cached_memory()
        raise DeviceOutOfMemoryError("step", detail)

    def follow(self, step: FollowerStep) -> PendingStep | FatalOnFailure:
        """A rank > 0 runs the step rank 0 packed (`follower_step.py`), without waiting; every
        failure is fatal, as every failure under tensor parallelism is."""
        try:
            self._issue_kv_copies(
                StepCopies(step.kv_loads, step.kv_stores, step.kv_fence, step.kv_late_loads)
            )
            self._faults.count()
            self.pools.swap(step.blocks_to_swap_out, to_cpu=True)
            self.pools.swap(step.blocks_to_swap_in, to_cpu=False)
            pending = self.steps.follow(step)
        except FatalEngineError:
            raise
        except Exception as exc:
            raise self.step_failure(exc) from exc
        return FatalOnFailure(pending, self.step_failure)

    def step_failure(self, exc: Exception) -> FatalEngineError:
        """What a failed step means under tensor parallelism (`step_faults`)."""
        return tensor_parallel_failure(self.tp.rank, self.followers, exc)

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

    def _issue_kv_copies(self, copies: StepCopies) -> None:
        """The host tier's copies of a step, before anything of the step can fail: the scheduler
        registered the loaded blocks already. A copy that cannot be issued leaves the prefix
        cache holding blocks it never filled, so it ends the engine."""
        if not (copies.loads or copies.stores or copies.late_loads or copies.fence):
            return
        assert self.host_tier is not None, "host tier copies without a host tier"
        try:
            self.host_tier.issue(copies)
        except Exception as exc:
            raise FatalEngineError(f"the host KV tier's copies failed: {exc}") from exc

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput) -> LaunchedStep:
        self._issue_kv_copies(
            StepCopies(out.kv_loads, out.kv_stores, out.kv_fence, out.kv_late_loads)
        )
        # Rank 0 packs the step once and hands the bytes to the other ranks before running it.
        inputs = None
        if out.seqs:
            inputs = self.steps.prepare(out.seqs, keep_packed=self.followers is not None)
        if self.followers is not None:
            self.followers.send(follower_step(out, inputs))
        self._faults.count()
        self.pools.swap(out.blocks_to_swap_out, to_cpu=True)
        self.pools.swap(out.blocks_to_swap_in, to_cpu=False)
        if inputs is None:
            return PendingStep(0, [], None, None)
        return self.steps.run(inputs, out.seqs)
