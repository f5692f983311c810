"""What the start-up memory profile drives (`memory.profile.ProfileTarget`): the runner's model
over a scratch KV cache, its sampler, and its step graphs, in the memory a serving step works
in."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagekeeper_engine.core.outputs import ScheduledSeq
from pagekeeper_engine.runner.step_launch import StepLauncher


class RunnerProfileTarget:
    """Profile steps through the runner's own step path (`steps`), over a scratch cache of any
    size shaped by `pool_shape`; the graphs are captured and released by the runner's own
    calls."""

    def __init__(
        self,
        steps: StepLauncher,
        workspace_bytes: int,  # the steps' buffers allocated so far (see ProfileTarget)
        pool_shape: Callable[[int], tuple[int, ...]],
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        capture_graphs: Callable[[], int],
        release_graphs: Callable[[], None],
    ):
        self.steps = steps
        self.workspace_bytes = workspace_bytes
        self.pool_shape = pool_shape
        self.kv_cache_dtype = kv_cache_dtype
        self.device = device
        self.scratch: torch.Tensor | None = None
        self._capture_graphs = capture_graphs
        self._release_graphs = release_graphs

    def bind_scratch_cache(self, num_blocks: int) -> int:
        """A cache of `num_blocks` blocks bound to the model; its bytes."""
        self.scratch = torch.zeros(
            self.pool_shape(num_blocks), dtype=self.kv_cache_dtype, device=self.device
        )
        self.steps.model.bind_kv_cache([(layer[0], layer[1]) for layer in self.scratch])
        return self.scratch.nbytes

    def release_scratch_cache(self) -> None:
        # The layers' views keep the scratch's storage alive: without unbinding them the real
        # pool is allocated while the scratch is still held, beyond the budget.
        self.steps.model.unbind_kv_cache()
        self.scratch = None

    @torch.inference_mode()
    def run_profile_batch(self, seqs: Sequence[ScheduledSeq], num_sampled_rows: int) -> None:
        """Forward `seqs`, then the logits and the sampling of `num_sampled_rows` rows."""
        model = self.steps.model
        step = self.steps.prepare(seqs)
        hidden = model(step.input_ids, step.positions, step.meta)  # (T, H)
        rows = torch.arange(num_sampled_rows, device=self.device) % hidden.shape[0]
        # (num_sampled_rows, V or the rank's shard), sampled as a step samples them
        logits = model.compute_logits(hidden[rows], self.steps.logits_out)
        params = [seqs[i % len(seqs)].sampling for i in range(num_sampled_rows)]
        self.steps.sample_rows(logits, params, [0] * num_sampled_rows)

    def capture_graphs(self) -> int:
        """Capture the step graphs over the bound cache; their pool's bytes (0: none)."""
        return self._capture_graphs()

    def release_graphs(self) -> None:
        self._release_graphs()
